"""Stop strings end generation exactly where the text first contains them."""

from hyflash.decoding import generate
from hyflash.proposers import NgramProposer


def test_stop_string_cuts_text_and_ends_generation(smollm2_fp32):
    target = smollm2_fp32
    ids = target.encode("Count from 1 to 20.")
    full = generate(target, ids, NgramProposer(), max_new_tokens=40)
    assert "\n" in full.text
    stopped = generate(target, ids, NgramProposer(), max_new_tokens=40, stop_strings=["\n"])
    assert stopped.stats.stop_reason == "stop_string"
    assert stopped.text == full.text[:full.text.index("\n")]
    # the tokens kept are a prefix of the unstopped output, ending with the token that completed the stop string
    n = len(stopped.token_ids)
    assert stopped.token_ids == full.token_ids[:n]
    assert "\n" in target.decode(stopped.token_ids) and "\n" not in target.decode(stopped.token_ids[:-1])
