"""Block keys: the published vectors, an independent reimplementation, stability and separation.

The vectors live in docs/key-format.md (its only ```json block). ``doc_*`` below reimplements the
recipe from that page with hashlib, struct and xxhash alone, so the page and kvstore/keys.py are
checked against each other, not only against themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.keys import HASHES, BlockHasher, Namespace
from kvstore.layout import DTYPE_NAMES, KVLayout
from kvstore.protocol import layout_from_dict

REPO = Path(__file__).resolve().parents[1]
KEY_FORMAT_DOC = REPO / "docs" / "key-format.md"

# The example layout; tests vary one field at a time around it.
BASE_FIELDS: dict[str, Any] = dict(
    num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, tp_rank=0, tp_size=1
)


ExtraKey = bytes | str | int
Extras = list[list[ExtraKey] | None]


def make_hasher(model_id: str = "test/model", hash_algo: str = "sha256", **layout_fields: Any) -> BlockHasher:
    return BlockHasher(Namespace(model_id, KVLayout(**{**BASE_FIELDS, **layout_fields}), hash_algo=hash_algo))


def small_hasher(hash_algo: str = "sha256") -> BlockHasher:
    """Four-token blocks keep the chain tests short."""
    return make_hasher(hash_algo=hash_algo, num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)


# ---------------------------------------------------------------------------------------------
# The recipe of docs/key-format.md, written from the page alone (no kvstore.keys internals).


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _lp(data: bytes) -> bytes:
    return _u32(len(data)) + data


def doc_hash(name: str, data: bytes) -> bytes:
    if name == "sha256":
        return hashlib.sha256(data).digest()
    assert name == "xxh3_128"
    return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big")  # canonical form: high half first


def doc_fingerprint(layout: dict[str, Any]) -> str:
    text = (
        f"L{layout['num_layers']}-H{layout['num_kv_heads']}-D{layout['head_dim']}-B{layout['block_size']}"
        f"-{layout['dtype']}-tp{layout['tp_rank']}of{layout['tp_size']}"
    )
    if layout.get("groups"):
        tags = [("f" if kind == "full" else f"s{window}") + ":" + ",".join(map(str, layers))
                for kind, layers, window in layout["groups"]]
        text += "-G" + "/".join(tags)
    return text


def doc_group_keys(hash_name: str, keys: list[bytes], group: int, num_groups: int) -> list[bytes]:
    if num_groups == 1:
        return keys
    return [doc_hash(hash_name, b"kvstore/group/v1\x00" + key + _u32(group)) for key in keys]


def doc_namespace_digest(model_id: str, layout: dict[str, Any], hash_name: str) -> bytes:
    body = (
        b"kvstore/namespace/v1\x00"
        + _lp(model_id.encode("utf-8"))
        + _lp(doc_fingerprint(layout).encode("ascii"))
        + _lp(hash_name.encode("ascii"))
        + _u32(1)
    )
    return hashlib.sha256(body).digest()


def doc_root(namespace_digest: bytes, hash_name: str, tenant: str) -> bytes:
    return doc_hash(hash_name, b"kvstore/root/v1\x00" + namespace_digest + _lp(tenant.encode("utf-8")))


def doc_extra(item: ExtraKey) -> bytes:
    if isinstance(item, bytes):
        return b"b" + _lp(item)
    if isinstance(item, str):
        return b"s" + _lp(item.encode("utf-8"))
    return b"i" + _lp(struct.pack("<q", item))


def doc_keys(
    hash_name: str,
    block_size: int,
    parent: bytes,
    tokens: list[int],
    extras: Extras | None = None,
) -> list[bytes]:
    keys = []
    for i in range(len(tokens) // block_size):
        block_extras = (extras[i] if extras is not None and i < len(extras) else None) or []
        body = (
            b"kvstore/block/v1\x00"
            + parent
            + _u32(block_size)
            + b"".join(_u32(t) for t in tokens[i * block_size : (i + 1) * block_size])
            + _u32(len(block_extras))
            + b"".join(doc_extra(e) for e in block_extras)
        )
        parent = doc_hash(hash_name, body)
        keys.append(parent)
    return keys


# ---------------------------------------------------------------------------------------------
# The published vectors.


def load_vectors() -> list[dict[str, Any]]:
    blocks = re.findall(r"^```json\n(.*?)^```", KEY_FORMAT_DOC.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 1, f"docs/key-format.md must hold exactly one json block, found {len(blocks)}"
    return json.loads(blocks[0])


VECTORS = load_vectors()


def decode_extra(kind: str, value: Any) -> ExtraKey:
    if kind == "b":
        return bytes.fromhex(value)
    assert kind in ("s", "i"), f"unknown extra type {kind!r}"
    return str(value) if kind == "s" else int(value)


def vector_extras(vector: dict[str, Any]) -> Extras | None:
    if vector["extras"] is None:
        return None
    return [[decode_extra(kind, value) for kind, value in block] for block in vector["extras"]]


def test_vectors_cover_the_promised_cases() -> None:
    assert len(VECTORS) >= 6
    assert any(v["tenant"] == "" for v in VECTORS) and any(v["tenant"] == "acme" for v in VECTORS)
    assert {"s", "b", "i"} <= {kind for v in VECTORS for block in v["extras"] or [] for kind, _ in block}
    assert {v["hash"] for v in VECTORS} == set(HASHES)
    assert any(len(v["keys"]) >= 2 for v in VECTORS) and any(v["parent"] for v in VECTORS)
    assert {v["hash"] for v in VECTORS if v["layout"].get("groups")} == set(HASHES)  # group keys, each hash


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_code_reproduces_vector(vector: dict[str, Any]) -> None:
    layout = layout_from_dict(vector["layout"])
    namespace = Namespace(vector["model_id"], layout, hash_algo=vector["hash"])
    hasher = BlockHasher(namespace)
    parent = bytes.fromhex(vector["parent"]) if vector["parent"] else None
    keys = hasher.block_keys(
        vector["tokens"], tenant=vector["tenant"], extra_keys=vector_extras(vector), parent=parent
    )
    assert layout.fingerprint() == vector["fingerprint"]
    assert namespace.digest.hex() == vector["namespace_digest"]
    if vector["root"] is not None:
        assert hasher.root(vector["tenant"]).hex() == vector["root"]
    assert [k.hex() for k in keys] == vector["keys"], (
        f"{vector['name']}: code gives {[k.hex() for k in keys]}"
    )
    assert all(len(k) == hasher.key_bytes for k in keys)
    for group, expected in enumerate(vector.get("group_keys", [])):
        assert [k.hex() for k in hasher.group_keys(keys, group)] == expected
    if "group_keys" not in vector:
        assert hasher.group_keys(keys, 0) == keys  # one group: the chain's keys


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_doc_recipe_reproduces_vector(vector: dict[str, Any]) -> None:
    digest = doc_namespace_digest(vector["model_id"], vector["layout"], vector["hash"])
    root = doc_root(digest, vector["hash"], vector["tenant"])
    parent = bytes.fromhex(vector["parent"]) if vector["parent"] else root
    keys = doc_keys(
        vector["hash"], vector["layout"]["block_size"], parent, vector["tokens"], vector_extras(vector)
    )
    assert doc_fingerprint(vector["layout"]) == vector["fingerprint"]
    assert digest.hex() == vector["namespace_digest"]
    if vector["root"] is not None:
        assert root.hex() == vector["root"]
    assert [k.hex() for k in keys] == vector["keys"]
    groups = vector.get("group_keys", [])
    for group, expected in enumerate(groups):
        assert [k.hex() for k in doc_group_keys(vector["hash"], keys, group, len(groups))] == expected


def test_worked_example_bytes_match_the_recipe() -> None:
    """The hex dumps of the first vector's hash inputs in the doc are the bytes the recipe hashes."""
    text = KEY_FORMAT_DOC.read_text(encoding="utf-8")
    dumps = ["".join(d.split()) for d in re.findall(r"^```\n([0-9a-f\n]+)^```", text, re.M)]
    namespace_body, root_body, block_body, extras_tail = (bytes.fromhex(d) for d in dumps)
    first = VECTORS[0]
    assert hashlib.sha256(namespace_body).hexdigest() == first["namespace_digest"]
    assert hashlib.sha256(root_body).hexdigest() == first["root"]
    assert hashlib.sha256(block_body).hexdigest() == first["keys"][0]
    typed_extras: list[ExtraKey] = ["lora:math-v2", b"\x00\xff\x10", 7, -1]
    assert extras_tail == _u32(4) + b"".join(doc_extra(e) for e in typed_extras)


# ---------------------------------------------------------------------------------------------
# Stability: no seed, no Python hash(), nothing per process.

_CHILD = """
import json
from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVLayout
out = {"hash_of_str": hash("kvstore")}
for algo in ("sha256", "xxh3_128"):
    h = BlockHasher(Namespace("test/model", KVLayout(24, 2, 64), hash_algo=algo))
    keys = h.block_keys(list(range(40)), tenant="acme", extra_keys=[["lora", b"x", 3]])
    out[algo] = [k.hex() for k in keys]
print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def child_keys() -> Iterator[subprocess.Popen[str]]:
    """A child process computing keys under another hash seed, started early: its torch import
    takes seconds, so it runs beside this module's other tests instead of after them."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "4242" else "4242"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, "PYTHONHASHSEED": seed},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield child
    if child.poll() is None:
        child.kill()
    child.communicate()


def test_separate_hasher_instances_agree() -> None:
    tokens = list(range(100, 164))
    assert make_hasher().block_keys(tokens, tenant="t") == make_hasher().block_keys(tokens, tenant="t")


# ---------------------------------------------------------------------------------------------
# Chaining.


@pytest.mark.parametrize("position", range(16))
def test_changing_one_token_changes_its_block_and_all_later_ones(position: int) -> None:
    hasher = small_hasher()
    tokens = list(range(1000, 1016))
    changed = tokens.copy()
    changed[position] += 1
    before, after = hasher.block_keys(tokens), hasher.block_keys(changed)
    block = position // 4
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def test_changing_extras_changes_that_block_and_later_ones() -> None:
    hasher = small_hasher()
    tokens = list(range(12))
    plain = hasher.block_keys(tokens)
    with_extra = hasher.block_keys(tokens, extra_keys=[None, ["lora-a"]])
    assert plain[0] == with_extra[0]
    assert plain[1] != with_extra[1] and plain[2] != with_extra[2]


def test_no_extras_equals_empty_extras_and_short_extras_list() -> None:
    hasher = small_hasher()
    tokens = list(range(12))
    plain = hasher.block_keys(tokens)
    assert hasher.block_keys(tokens, extra_keys=[]) == plain
    assert hasher.block_keys(tokens, extra_keys=[[], None, ()]) == plain
    assert hasher.block_keys(tokens, extra_keys=[["x"]])[1:] != plain[1:]


def test_extras_are_typed_and_ordered() -> None:
    hasher = small_hasher()
    tokens = list(range(4))
    variants: list[list[ExtraKey]] = [
        ["7"],
        [b"7"],
        [7],
        ["a", "b"],
        ["b", "a"],
        ["ab"],
        ["a", ""],
        [""],
        [b""],
        [0],
        [-1],
    ]
    keys = [hasher.block_keys(tokens, extra_keys=[v])[0] for v in variants]
    assert len(set(keys)) == len(variants)


def test_continuation_equals_whole_sequence() -> None:
    hasher = small_hasher()
    tokens = list(range(50, 70))  # 5 blocks
    extras: Extras = [None, ["lora"], None, [b"img", 2], None]
    whole = hasher.block_keys(tokens, tenant="acme", extra_keys=extras)
    for split in range(6):
        head = hasher.block_keys(tokens[: 4 * split], tenant="acme", extra_keys=extras[:split])
        parent = head[-1] if head else None
        tail = hasher.block_keys(tokens[4 * split :], tenant="acme", extra_keys=extras[split:], parent=parent)
        assert head + tail == whole


# Fixed alphabets: st.text() would build Hypothesis's Unicode table on first use (seconds).
_TEXT = st.text(alphabet="aZ0 -:/\x00é\u0301ü\u4e2d\U0001f600", max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    split_block=st.integers(0, 10),
    tenant=_TEXT,
)
def test_property_continuation_equals_whole(tokens: list[int], split_block: int, tenant: str) -> None:
    hasher = small_hasher()
    split = 4 * min(split_block, len(tokens) // 4)
    whole = hasher.block_keys(tokens, tenant=tenant)
    head = hasher.block_keys(tokens[:split], tenant=tenant)
    tail = hasher.block_keys(tokens[split:], tenant=tenant, parent=head[-1] if head else None)
    assert head + tail == whole
    assert len(whole) == len(tokens) // 4


_extra_items = st.one_of(st.binary(max_size=6), _TEXT, st.integers(-(2**63), 2**63 - 1))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=24),
    tenant=_TEXT,
    extras=st.lists(st.one_of(st.none(), st.lists(_extra_items, max_size=3)), max_size=6),
    algo=st.sampled_from(sorted(HASHES)),
)
def test_property_code_matches_doc_recipe(tokens: list[int], tenant: str, extras: Extras, algo: str) -> None:
    extras = extras[: len(tokens) // 4]
    layout = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "block_size": 4, "dtype": "float16"}
    layout |= {"tp_rank": 0, "tp_size": 1}
    hasher = small_hasher(algo)
    root = doc_root(doc_namespace_digest("test/model", layout, algo), algo, tenant)
    assert hasher.root(tenant) == root
    assert hasher.block_keys(tokens, tenant=tenant, extra_keys=extras) == doc_keys(
        algo, 4, root, tokens, extras
    )


# ---------------------------------------------------------------------------------------------
# Separation: tenants, models, layouts and hashes never share keys.

_TOKENS = list(range(7, 7 + 64))

LAYOUT_VARIANTS: dict[str, list[Any]] = {
    "num_layers": [1, 24, 25],
    "num_kv_heads": [1, 2, 8],
    "head_dim": [64, 128],
    "block_size": [8, 16, 32],
    "dtype": list(DTYPE_NAMES),
    "tp_rank": [0, 1, 3],
    "tp_size": [4, 5],
}


@pytest.mark.parametrize("field", sorted(LAYOUT_VARIANTS))
def test_each_layout_field_separates_keys(field: str) -> None:
    fixed = {"tp_size": 4} if field == "tp_rank" else {}
    hashers = [make_hasher(**{**fixed, field: value}) for value in LAYOUT_VARIANTS[field]]
    assert len({h.namespace.digest for h in hashers}) == len(hashers)
    assert len({h.root("acme") for h in hashers}) == len(hashers)
    assert len({h.block_keys(_TOKENS, tenant="acme")[0] for h in hashers}) == len(hashers)


def test_tenants_model_ids_layouts_and_hashes_never_share_keys() -> None:
    tenants = ["", "acme", "Acme", "acme ", " acme", "\x00", unicodedata.normalize("NFC", "é"), "e\u0301"]
    model_ids = ["test/model", "test/model2", "Test/model", "test/model\x00"]
    hashers = [make_hasher(model_id=m) for m in model_ids]
    hashers += [make_hasher(hash_algo="xxh3_128")]
    hashers += [
        make_hasher(**{f: v}) for f, values in LAYOUT_VARIANTS.items() for v in values if f != "tp_rank"
    ]
    hashers += [make_hasher(tp_rank=r, tp_size=4) for r in range(4)]
    keys = [(h.block_keys(_TOKENS, tenant=t)[0], h.namespace.digest, t) for h in hashers for t in tenants]
    distinct_namespaces = {(digest, t) for _, digest, t in keys}
    assert len({k for k, _, _ in keys}) == len(distinct_namespaces)
    assert len({h.namespace.digest for h in hashers}) == len({h.namespace for h in hashers})


def test_hashes_differ_beyond_length() -> None:
    sha = make_hasher().block_keys(_TOKENS)
    xxh = make_hasher(hash_algo="xxh3_128").block_keys(_TOKENS)
    assert [len(k) for k in sha] == [32] * 4 and [len(k) for k in xxh] == [16] * 4
    assert all(x != s[:16] and x != s[-16:] for x, s in zip(xxh, sha, strict=True))


def test_namespace_id_is_digest_prefix() -> None:
    namespace = make_hasher().namespace
    assert namespace.id == namespace.digest.hex()[:16]


# ---------------------------------------------------------------------------------------------
# Only full blocks; token containers.


def test_only_full_blocks_get_keys() -> None:
    hasher = small_hasher()
    tokens = list(range(200, 214))
    whole = hasher.block_keys(tokens)
    for n in range(len(tokens) + 1):
        keys = hasher.block_keys(tokens[:n])
        assert len(keys) == n // 4
        assert keys == whole[: n // 4]


def test_empty_input_gives_no_keys() -> None:
    hasher = small_hasher()
    assert hasher.block_keys([]) == []
    assert hasher.block_keys(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize(
    "convert",
    [
        tuple,
        lambda t: [np.int64(x) for x in t],
        lambda t: np.array(t, dtype=np.int16),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=">u4"),
        lambda t: np.array(t, dtype=">i8"),
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # non-contiguous view
    ],
    ids=["tuple", "numpy-scalars", "i2", "u2", "i4", "u4", "i8", "u8", "big-u4", "big-i8", "strided"],
)
def test_token_containers_and_int_dtypes_give_same_keys(convert: Any) -> None:
    hasher = small_hasher()
    tokens = [0, 1, 2, 3, 255, 256, 1000, 32767, 9, 8, 7, 6, 5]
    assert hasher.block_keys(convert(tokens), tenant="acme") == hasher.block_keys(tokens, tenant="acme")


def test_large_ids_same_in_list_and_numpy() -> None:
    hasher = small_hasher()
    tokens = [2**32 - 1, 2**31, 2**31 - 1, 2**16]
    expected = hasher.block_keys(tokens)
    assert hasher.block_keys(np.array(tokens, dtype=np.uint32)) == expected
    assert hasher.block_keys(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.block_keys(np.array(tokens, dtype=np.uint64)) == expected


# ---------------------------------------------------------------------------------------------
# Bad input gets a clear error.


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, -1, 4], r"\[0, 2\*\*32\)"),
        (np.array([1, 2, -1, 4]), r"min -1"),
        ([1, 2, 2**32, 4], r"\[0, 2\*\*32\)"),
        (np.array([1, 2, 2**32, 4], dtype=np.int64), r"max 4294967296"),
        (np.array([1, 2, 2**64 - 1, 4], dtype=np.uint64), r"max 18446744073709551615"),
        ([1, 2, 3.0, 4], r"\[0, 2\*\*32\)"),
        (np.array([1.0, 2.0, 3.0, 4.0]), r"dtype float64"),
        (np.array([True, False, True, False]), r"dtype bool"),
        (np.arange(8).reshape(2, 4), r"one-dimensional, got shape \(2, 4\)"),
        ([[1, 2, 3, 4]], r"\[0, 2\*\*32\)"),
        ("abcd", r"one-dimensional"),
    ],
    ids=[
        "negative-list",
        "negative-numpy",
        "2**32-list",
        "2**32-numpy",
        "u64-max-numpy",
        "float-list",
        "float-numpy",
        "bool-numpy",
        "2d-array",
        "nested-list",
        "str",
    ],
)
def test_bad_token_ids_raise_value_error(tokens: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        small_hasher().block_keys(tokens)


def test_too_many_extra_key_lists() -> None:
    with pytest.raises(ValueError, match="3 extra-key lists for 2 full blocks"):
        small_hasher().block_keys(list(range(9)), extra_keys=[None, None, ["x"]])


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (True, "not bool"),
        (False, "not bool"),
        (1.5, "got float"),
        (None, "got NoneType"),
        (["x"], "got list"),
    ],
)
def test_bad_extra_keys_raise_type_error(item: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        small_hasher().block_keys(list(range(4)), extra_keys=[[item]])


@pytest.mark.parametrize("tenant", [b"acme", 7, None])
def test_non_str_tenant_raises_type_error(tenant: Any) -> None:
    with pytest.raises(TypeError, match="tenant must be a str"):
        small_hasher().block_keys(list(range(4)), tenant=tenant)


@pytest.mark.parametrize("model_id", ["", None, b"test/model"])
def test_bad_model_id_raises_config_error(model_id: Any) -> None:
    with pytest.raises(ConfigError, match="model_id must be a non-empty string"):
        Namespace(model_id, KVLayout(**BASE_FIELDS))


@pytest.mark.parametrize("algo", ["md5", "SHA256", "xxh3", ""])
def test_unknown_hash_algo_raises_config_error(algo: str) -> None:
    with pytest.raises(ConfigError, match=f"hash_algo must be one of .*got '{algo}'"):
        Namespace("test/model", KVLayout(**BASE_FIELDS), hash_algo=algo)
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------------------------------------
# Bad inputs found in review: each gets a clear error, never a silent different key.


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_int_extra_outside_i64_raises_value_error(value: int) -> None:
    with pytest.raises(ValueError, match="int64"):
        small_hasher().block_keys(list(range(4)), extra_keys=[[value]])


@pytest.mark.parametrize("extras", ["lora-a", b"lora-a"])
def test_bare_str_or_bytes_as_block_extras_is_rejected(extras: Any) -> None:
    """``extra_keys=["lora-a"]`` silently means one extra per character today."""
    with pytest.raises(TypeError, match="sequence of extra keys"):
        small_hasher().block_keys(list(range(4)), extra_keys=[extras])


@pytest.mark.parametrize("parent", [b"short", b"\x00" * 16, "ab" * 32])
def test_parent_must_be_a_key_of_this_namespace(parent: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="parent must be 32 bytes"):
        small_hasher().block_keys(list(range(4)), parent=parent)


def test_unhashable_tenant_gets_the_clear_message() -> None:
    with pytest.raises(TypeError, match="tenant must be a str"):
        small_hasher().block_keys(list(range(4)), tenant=["acme"])  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [-1, 2**32, True, "1"])
def test_bad_format_version_raises_config_error(version: Any) -> None:
    with pytest.raises(ConfigError, match="format_version"):
        Namespace("test/model", KVLayout(**BASE_FIELDS), format_version=version)


# Last on purpose: the child process started by the fixture had the whole module to finish.
def test_keys_identical_across_processes_with_different_hash_seeds(child_keys: subprocess.Popen[str]) -> None:
    stdout, stderr = child_keys.communicate(timeout=120)
    assert child_keys.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["hash_of_str"] != hash("kvstore"), "the child should hash str differently from us"
    for algo in ("sha256", "xxh3_128"):
        here = make_hasher(hash_algo=algo).block_keys(
            list(range(40)), tenant="acme", extra_keys=[["lora", b"x", 3]]
        )
        assert len(here) == 2
        assert result[algo] == [k.hex() for k in here]
