"""PrefixKV: recorded K/V served as leaves whose gradients reach the recording pass exactly."""

import pytest
import torch

from prefix_sharing.prefix_kv import PrefixKV


def test_readers_gradients_reach_the_recorded_pass_as_one_graph_would():
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64)  # the "prefix" input
    own = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]

    # one graph: every reader concatenates the prefix's k = v = x @ w before its own rows
    k = x @ w
    direct = sum((torch.cat([k, o]) ** 2).sum() + torch.cat([k, o]).sin().sum() for o in own)
    direct = direct + k.sum()  # the prefix's own loss terms
    (expected,) = torch.autograd.grad(direct, w)

    store = PrefixKV()
    k = x @ w
    assert store.exchange(1, k, k) == (k, k)  # recording returns its own K/V
    k_leaf, v_leaf = store.leaves[1]
    assert k_leaf.is_leaf and k_leaf.requires_grad and k_leaf.data_ptr() == k.data_ptr()
    store.mode = "read"
    for o in own:
        key, value = store.exchange(1, o, o)
        assert key.shape == (6, 3)
        ((key ** 2).sum() + value.sin().sum()).backward()
    assert store.held_bytes() == 4 * k.numel() * k.element_size()  # K, V and their grads
    (store.gradient_term() + k.sum()).backward()
    torch.testing.assert_close(w.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_recompute_keeps_the_leaves_and_their_gradients():
    store = PrefixKV()
    with torch.no_grad():
        store.exchange(1, torch.ones(2, 1), torch.ones(2, 1))
    leaves = store.leaves[1]
    store.mode = "read"
    store.exchange(1, torch.zeros(1, 1), torch.zeros(1, 1))[0].sum().backward()
    store.mode = "record"
    w = torch.ones(1, requires_grad=True)
    store.exchange(1, torch.ones(2, 1) * w, torch.ones(2, 1) * w)
    assert store.leaves[1] is leaves and torch.equal(leaves[0].grad, torch.ones(2, 1))
    store.gradient_term().backward()
    assert w.grad.item() == 2.0  # dK only (V was not read by the loss): one per prefix row


def test_a_pass_without_a_graph_has_no_gradient_term():
    """A recorded pass that kept no graph (recomputed layers) hands its gradients over in its
    replay, not through the term."""
    store = PrefixKV()
    with torch.no_grad():
        store.exchange(1, torch.ones(2, 1), torch.ones(2, 1))
    store.mode = "read"
    store.exchange(1, torch.zeros(1, 1), torch.zeros(1, 1))[0].sum().backward()
    term = store.gradient_term()
    assert term.item() == 0.0 and not term.requires_grad


def test_one_backward_per_reader_then_the_gradient_term_equals_one_graph():
    """A loop that runs one backward per micro-batch: every reader reads the leaves, then the
    prefix's own backward step carries their accumulated gradients in (the gradient term, its
    leaves' gradients read when that backward runs), once."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    own = [torch.randn(2, 3, dtype=torch.float64) for _ in range(3)]

    def reader_loss(key, value):
        return (key ** 2).sum() + value.sin().sum()

    k = x @ w
    expected = torch.autograd.grad(sum(reader_loss(torch.cat([k, o]), torch.cat([k, o]))
                                       for o in own) + k.sum(), w)[0]

    store = PrefixKV()
    k = x @ w
    store.exchange(1, k, k)
    term = store.gradient_term() + k.sum()  # built before the readers run: read lazily
    store.mode = "read"
    for o in own:
        reader_loss(*store.exchange(1, o, o)).backward()
    term.backward()
    torch.testing.assert_close(w.grad, expected, rtol=1e-12, atol=1e-12)


def test_reading_through_without_grad_is_the_recorded_tensor():
    from prefix_sharing.prefix_kv import read_through

    recorded = torch.ones(2, 1)
    assert read_through(recorded, recorded.clone().requires_grad_(True)) is recorded


def _recomputed_prefix_run(read_last_backward_first: bool = True):
    """A prefix layer under activation recompute: its first run without grad (inside the
    checkpoint), readers, then its replay with grad inside the prefix's backward."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    own = [torch.randn(2, 3, dtype=torch.float64) for _ in range(2)]
    store = PrefixKV()
    prefix = store.forward_pass("record")
    with torch.no_grad():
        prefix.exchange(1, x @ w, x @ w)  # the first run: values recorded, no graph
    leaves = store.leaves[1]
    readers = [store.forward_pass("read"), store.forward_pass("read")]
    losses = [((torch.cat(r.exchange(1, o, o)) ** 2).sum()) for r, o in zip(readers, own)]
    return store, prefix, w, x, own, leaves, losses


def test_a_recomputed_prefix_layer_records_once_and_its_replay_takes_in_every_reader():
    store, prefix, w, x, own, leaves, losses = _recomputed_prefix_run()
    assert not store.outputs  # nothing to differentiate: the first run kept no graph
    for loss in losses:  # the last reader too reads the leaves (nothing recorded to read)
        loss.backward()
    k = x @ w  # the replay, with grad: the second call of the same pass
    key, value = prefix.exchange(1, k, k)
    assert store.leaves[1] is leaves and not store.outputs  # recorded once
    (key.sum() + value.sum()).backward()
    kk = x @ w
    expected = torch.autograd.grad(
        sum((torch.cat([kk, o, kk, o]) ** 2).sum() for o in own) + 2 * kk.sum(), w)[0]
    torch.testing.assert_close(w.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_prefix_replay_before_a_readers_backward_is_refused():
    store, prefix, w, x, _, _, losses = _recomputed_prefix_run()
    losses[0].backward()  # the other reader's backward has not run
    key, value = prefix.exchange(1, x @ w, x @ w)
    with pytest.raises(RuntimeError, match="before 2 of its readers"):
        (key.sum() + value.sum()).backward()


def test_a_pass_keeps_its_mode_whatever_the_store_says_later():
    store = PrefixKV()
    k = torch.ones(2, 1)
    store.exchange(1, k, k)
    reader = store.forward_pass()  # bound now, in the store's mode
    assert reader.mode == "record"
    store.mode = "read"
    assert store.forward_pass().mode == "read" and reader.mode == "record"


def test_a_reader_gets_the_stored_kv_as_sources_and_exchange_concatenates_them():
    """key_sources hands a reader the stack's leaves themselves, in row order, beside its own
    K/V (the attention reads them in place: tests/attention/test_sources.py); exchange, the
    gathering paths' view, is their concatenation in front."""
    from prefix_sharing.prefix_kv import PrefixKVStack

    blocks = [PrefixKV(), PrefixKV()]
    for rows, store in zip((2, 3), blocks):
        store.exchange(1, torch.full((rows, 1), float(rows)), torch.zeros(rows, 1))
        store.mode = "read"
    own = torch.ones(1, 1)
    sources, key, value = PrefixKVStack(blocks).forward_pass().key_sources(1, own, own)
    assert key is own and value is own
    handed = [t for pair in sources for t in pair]
    stored = [t for block in blocks for t in block.leaves[1]]
    assert len(handed) == 4 and all(a is b for a, b in zip(handed, stored))
    key, _ = PrefixKVStack(blocks).exchange(1, own, own)
    assert key.flatten().tolist() == [2, 2, 3, 3, 3, 1]
