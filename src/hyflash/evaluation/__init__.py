"""Evaluation: suites (`suites`), the side-by-side runner behind `hyflash eval` (`runner`), and the tables and
plots behind `hyflash report` (`report`)."""
