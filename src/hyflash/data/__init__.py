"""Offline data: pinned sources (`sources`) and the decontaminated train/eval split (`split`)."""
