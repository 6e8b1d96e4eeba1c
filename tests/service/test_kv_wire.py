"""The sidecar's KV events as vLLM's side sees them: the block hashes `BlockHasher` computes
equal vLLM's `hash_block_tokens` chain for the same tokens (both reproducible algorithms, the
default seed and a `PYTHONHASHSEED`-style one, bytes and the 64-bit integer form), and a
batch the publisher encodes decodes with vLLM's own `KVEventBatch` into the same events."""

from __future__ import annotations

import random

import pytest

from hicache.service.kv_hashes import BlockHasher

kv_cache_utils = pytest.importorskip(
    "vllm.v1.core.kv_cache_utils", reason="vLLM is not installed (its hashing is the reference)"
)
hashing = pytest.importorskip("vllm.utils.hashing")

PAGE = 16


def vllm_chain(fn_name: str, seed: str, tokens: list[int], monkeypatch: pytest.MonkeyPatch):
    fn = hashing.get_hash_fn_by_name(fn_name)
    monkeypatch.setenv("PYTHONHASHSEED", seed)  # vLLM derives NONE_HASH from it when set
    kv_cache_utils.init_none_hash(fn)
    hashes, parent = [], None
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start : start + PAGE])
        hashes.append(bytes(parent))
    return hashes


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", ["vllm-none-hash", "1234"])
def test_block_hashes_equal_vllms_for_the_same_tokens(
    algo: str, seed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(7)
    # token ids across CBOR's and pickle's integer widths, and a partial trailing block
    edges = [0, 23, 24, 255, 256, 65_535, 65_536, 2**31 - 1, 2**32 - 1, 2**32]
    tokens = [rng.randrange(200_000) for _ in range(5 * PAGE)] + edges + [1] * (PAGE + 3)
    expected = vllm_chain(algo, seed, tokens, monkeypatch)
    hasher = BlockHasher(algo, seed)  # type: ignore[arg-type]
    assert hasher.chain(tokens, PAGE) == expected
    assert len(expected) == (len(tokens)) // PAGE
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    ints = BlockHasher(algo, seed, int_hashes=True)  # type: ignore[arg-type]
    assert [ints.external(h) for h in expected] == [
        kv_cache_utils.maybe_convert_block_hash(h) for h in expected
    ]


def test_an_algorithm_vllm_cannot_reproduce_across_processes_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^prefix caching hash 'xxhash' is not one the sidecar computes; allowed: "
        r"\['sha256', 'sha256_cbor'\]",
    ):
        BlockHasher("xxhash")  # type: ignore[arg-type]


def test_vllms_decoder_reads_a_published_batch_as_the_same_events() -> None:
    pytest.importorskip("zmq")
    events_mod = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    from hicache.service.kv_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "", queue_depth=4, hwm=4)
    try:
        h = BlockHasher().chain(list(range(2 * PAGE)), PAGE)
        payload = publisher.encode(
            [
                ("cleared",),
                ("stored", "CPU", h, None, list(range(2 * PAGE)), PAGE),
                ("stored", "STORAGE", h[1:], h[0], list(range(PAGE, 2 * PAGE)), PAGE),
                ("removed", "CPU", h),
            ],
            ts=12.5,
        )
    finally:
        publisher.close()
    batch = msgspec.msgpack.Decoder(events_mod.KVEventBatch).decode(payload)
    assert batch.ts == 12.5
    assert batch.data_parallel_rank is None
    cleared, stored, persisted, removed = batch.events
    assert isinstance(cleared, events_mod.AllBlocksCleared)
    assert stored == events_mod.BlockStored(
        block_hashes=h,
        parent_block_hash=None,
        token_ids=list(range(2 * PAGE)),
        block_size=PAGE,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    assert (persisted.block_hashes, persisted.parent_block_hash, persisted.medium) == (
        h[1:],
        h[0],
        "STORAGE",
    )
    assert removed == events_mod.BlockRemoved(block_hashes=h, medium="CPU")
