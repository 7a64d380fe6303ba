"""Generation: the text a sample hands out as tokens arrive, with stop strings and incomplete
UTF-8 held back until they resolve (the server's streaming depends on these exact rules)."""

from __future__ import annotations

from kvstore.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput
from kvstore.services.engine_server.generation import Generation
from kvstore.services.engine_server.tokenizer import ByteTokenizer


def feed(gen: Generation, text: bytes, finish: str | None = None) -> list[tuple[int, str, str | None]]:
    """Feed ``text`` one byte-token at a time; every delta, as (index, text, finish_reason)."""
    out = []
    ids: list[int] = []
    for k, b in enumerate(text):
        ids.append(b)
        last = k == len(text) - 1
        reason = finish if last else None
        ro = RequestOutput("r", gen.prompt_token_ids, [CompletionOutput(0, list(ids), None, reason)],
                           last and finish is not None, RequestMetrics())
        out += [(d.index, d.text, d.finish_reason) for d in gen.update(ro, float(k))]
        if gen.done:
            break
    return out


def gen(stops: list[str] | None = None) -> Generation:
    return Generation("r", [1, 2, 3], 1, stops or [], ByteTokenizer())


def test_text_goes_out_as_it_comes_and_ends_with_the_finish() -> None:
    deltas = feed(gen(), b"abc", "length")
    assert deltas == [(0, "a", None), (0, "b", None), (0, "c", "length")]


def test_incomplete_utf8_is_held_back_until_it_completes() -> None:
    g = gen()
    deltas = feed(g, "aé€b".encode(), "length")  # é is 2 bytes, € is 3
    assert "".join(d[1] for d in deltas) == "aé€b"
    assert all("\ufffd" not in d[1] for d in deltas)
    assert g.samples[0].num_tokens == len("aé€b".encode())


def test_stop_string_across_tokens_cuts_before_it() -> None:
    g = gen(["STOP"])
    deltas = feed(g, b"hello STOP world", "length")
    assert "".join(d[1] for d in deltas) == "hello "
    assert deltas[-1][2] == "stop" and g.done and not g.closed  # the server aborts the engine request
    assert g.samples[0].num_tokens == len(b"hello STOP")


def test_a_partial_stop_is_released_when_it_does_not_complete() -> None:
    # the last len("STOP") - 1 = 3 characters wait: they could begin the stop string
    assert feed(gen(["STOP"]), b"a STO b", "length") == [(0, "a", None), (0, " ", None), (0, "S", None),
                                                          (0, "TO b", "length")]


def test_the_earliest_of_several_stops_wins() -> None:
    deltas = feed(gen(["zz", "b"]), b"aabzz", "length")
    assert "".join(d[1] for d in deltas) == "aa" and deltas[-1][2] == "stop"


def test_timing_gaps_and_ttft() -> None:
    g = gen()
    feed(g, b"abcd", "length")
    assert g.ttft_s == 0.0 and g.gaps == [1.0, 1.0, 1.0]
