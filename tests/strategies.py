"""Hypothesis strategies for micro-batches with every kind of prefix sharing."""

from hypothesis import strategies as st

tokens = st.integers(0, 5)  # a tiny vocabulary, so sequences also share by coincidence


@st.composite
def forests(draw: st.DrawFn, max_sequences: int = 10, max_new_tokens: int = 8) -> list[list[int]]:
    """Sequences grown from earlier ones: shared prefixes of any length, chains, trees,
    duplicates (nothing appended) and strict prefixes (cut, nothing appended) - or unrelated."""
    n = draw(st.integers(1, max_sequences))
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(tokens, min_size=0 if cut else 1, max_size=max_new_tokens))
            seqs.append(base[:cut] + tail)
        else:
            seqs.append(draw(st.lists(tokens, min_size=1, max_size=max_new_tokens + 4)))
    return seqs
