"""The tile lookup: the user's cache folder, the read order, the default of a card without a table, the shared-memory
rule, and the user's tuning command end to end under the interpreter (no GPU needed)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from runtime import moe_tiles as mt

H200_NAME = "NVIDIA H200"
DSV3 = (257, 7168, 2048, 9)  # slots, hidden, intermediate, slots_per_token
H100 = mt.CardInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 3.35e12)
H200 = mt.CardInfo(H200_NAME, (9, 0), 132, 232448, 4.8e12)
A100 = mt.CardInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 2.04e12)
L40S = mt.CardInfo("NVIDIA L40S", (8, 9), 142, 101376, 0.86e12)


@pytest.fixture(autouse=True)
def _fresh_lookup():
    mt.clear_caches()
    yield
    mt.clear_caches()


def lookup(T, card, user_dir=None, triton="3.6.0", own_tables=True, shape=DSV3):
    return mt.tile_config(T, *shape, True, card.name, "bfloat16", card, triton, user_dir, own_tables)


def shipped():
    return {os.path.basename(p): json.load(open(p)) for p in glob.glob(os.path.join(mt.CONFIG_DIR, "moe_*.json"))}


def user_table(path, device=H200_NAME, entry=None, shape=DSV3, dtype="fp8_e4m3_block128"):
    """A valid user cache table whose only entry is ``entry`` (a distinctive config) at T = 1."""
    entry = entry or dict(mt.builtin_tile_config(1, True), gemm1_split_k=3, gemm1_fused_activation=False)
    doc = dict(device=device, dtype=dtype, triton="3.6.0", shapes={mt.shape_key(*shape): {"1": entry}})
    with open(path, "w") as f:
        json.dump(doc, f)
    return entry


def test_cache_folder_follows_xdg_then_home(monkeypatch, tmp_path):
    assert mt.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "fuse-shared" / "moe_tiles")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for env in ({}, {"XDG_CACHE_HOME": ""}):
        assert mt.cache_dir(env) == str(tmp_path / "home" / ".cache" / "fuse-shared" / "moe_tiles")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mt.cache_dir() == str(tmp_path / "xdg" / "fuse-shared" / "moe_tiles")  # read at each call
    name = mt.cache_file_name("NVIDIA H100 80GB HBM3", "fp8_e4m3_block128", "3.6.0")
    assert name == "moe_fp8_e4m3_block128_NVIDIA_H100_80GB_HBM3_triton-3.6.0.json"


def test_user_table_is_read_before_the_shipped_one(tmp_path):
    shipped_cfg, src = lookup(1, H200, str(tmp_path))
    assert src.startswith(f"table {mt.table_file_name(H200_NAME, 'fp8_e4m3_block128')} ")
    entry = user_table(tmp_path / mt.cache_file_name(H200_NAME, "fp8_e4m3_block128", "3.6.0"))
    mt.clear_caches()
    cfg, src = lookup(1, H200, str(tmp_path))
    assert src.startswith("cache ") and cfg == entry and cfg != shipped_cfg
    # another Triton version does not read it; nor does the "table removed" lookup
    assert lookup(1, H200, str(tmp_path), triton="3.7.0")[0] == shipped_cfg
    assert not lookup(1, H200, str(tmp_path), own_tables=False)[1].startswith("cache ")
    # a shape the user's table lacks still finds the shipped table's entry for it
    glm = (161, 5120, 1536, 9)
    assert lookup(1, H200, str(tmp_path), shape=glm)[1].startswith("table ")


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps(dict(device="NVIDIA H100 80GB HBM3", dtype="fp8_e4m3_block128", shapes={})),
        json.dumps(dict(device=H200_NAME, dtype="fp8_e4m3_block128", shapes={"k": {"1": {"block_m": 24}}})),
        json.dumps(dict(device=H200_NAME, dtype="fp8_e4m3_block128", shapes={"k": {"one": {}}})),
        json.dumps(dict(device=H200_NAME, dtype="fp8_e4m3_block128", shapes={"k": {"1": {"bogus": 1}}})),
    ],
    ids=["truncated", "not-an-object", "other-device", "bad-value", "bad-token-key", "unknown-key"],
)
def test_corrupt_user_table_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / mt.cache_file_name(H200_NAME, "fp8_e4m3_block128", "3.6.0")
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="tuned tile table ignored"):
        cfg, src = lookup(1, H200, str(tmp_path))
    assert src.startswith("table ")  # the shipped table still applies
    mt.clear_caches()
    assert cfg == lookup(1, H200, None)[0]


def test_card_without_a_table_takes_the_nearest_table_of_its_architecture(tmp_path):
    tables = shipped()
    cfg, src = lookup(4096, mt.CardInfo("NVIDIA H20", (9, 0), 78, 232448, 4.0e12), str(tmp_path))
    kind, name, which = src.split(" ", 2)
    assert kind == "nearest" and name in tables and which == mt.shape_key(*DSV3)
    assert {k: cfg[k] for k in tables[name]["shapes"][which]["4096"]} == tables[name]["shapes"][which]["4096"]
    # another architecture: no Hopper table, the built-in rules (stages fitted to its shared memory)
    for card in (A100, L40S):
        cfg, src = lookup(4096, card, str(tmp_path))
        assert src == "builtin"
        assert cfg == mt.fit_shared_memory(mt.builtin_tile_config(4096, True), card.smem_per_block, True)
    # a shape no table holds: the nearest table's default
    assert lookup(8, H100, str(tmp_path), own_tables=False, shape=(9, 256, 128, 3))[1].endswith(" default")


def test_nearest_cards_order_by_capability_then_sms_and_bandwidth():
    cards = (
        (mt.CardInfo("A", (9, 0), 132, 232448, 3.35e12), "a.json"),
        (mt.CardInfo("B", (9, 0), 132, 232448, 4.8e12), "b.json"),
        (mt.CardInfo("C", (9, 1), 132, 232448, 4.0e12), "c.json"),
        (mt.CardInfo("D", (8, 0), 108, 166912, 4.0e12), "d.json"),
        (mt.CardInfo("E", (9, 0), 114, 232448, 2.0e12), "e.json"),
    )
    h20 = mt.CardInfo("H20", (9, 0), 78, 232448, 4.0e12)
    # same major only; minor first (C last of the 9.x); then |log SM ratio| + |log bandwidth ratio|
    assert mt.nearest_cards(h20, cards) == ["a.json", "b.json", "e.json", "c.json"]
    assert mt.nearest_cards(mt.CardInfo("B", (9, 0), 132, 0, 0.0), cards) == ["a.json", "e.json", "c.json"]
    # unknown bandwidth (0): SMs alone decide
    assert mt.card_distance(mt.CardInfo("X", (9, 0), 66, 0, 0.0), cards[1][0]) == (0, pytest.approx(0.6931, 1e-3))


def test_stages_fit_the_cards_shared_memory():
    for table in shipped().values():  # every shipped Hopper entry fits a Hopper card unchanged
        for part in [*table["shapes"].values(), table["default"]]:
            for entry in part.values():
                cfg = dict(mt.builtin_tile_config(1, True), **entry)
                assert mt.fit_shared_memory(cfg, H100.smem_per_block, True) == cfg
    cfg = mt.builtin_tile_config(4096, True)  # paired 2x128 FP8 columns, 64 rows, 3 stages: 120 KiB
    assert mt.shared_memory_estimate(cfg, True) == 3 * 128 * (64 + 256)
    fitted = mt.fit_shared_memory(cfg, L40S.smem_per_block, True)
    assert fitted["gemm1_stages"] == 2 and mt.shared_memory_estimate(fitted, True) <= L40S.smem_per_block - 16384
    assert {k: v for k, v in fitted.items() if k != "gemm1_stages"} == {
        k: v for k, v in cfg.items() if k != "gemm1_stages"
    }
    tiny = mt.fit_shared_memory(cfg, 32 * 1024, True)  # never below two stages, even where nothing fits
    assert tiny["gemm1_stages"] == tiny["gemm2_stages"] == 2


def test_shipped_tables_record_their_card():
    for name, table in shipped().items():
        card = mt.CardInfo.from_json(table["device"], table["card"])
        assert card.capability[0] >= 9 and card.sms > 0 and card.smem_per_block > 0 and card.mem_bandwidth > 0
        assert (card, name) in mt._shipped_cards(table["dtype"])


def test_user_tuning_writes_the_cache_and_the_lookup_reads_it(tmp_path, monkeypatch):
    """runtime.tune_moe on a tiny shape under the interpreter: candidates checked against the reference and timed,
    the table merged into the cache folder (never the package's), then read back first by the lookup."""
    from runtime import tune_moe
    from runtime._backend import triton_available

    if not triton_available():
        pytest.skip("needs Triton (the interpreter on CPU)")
    res = tune_moe.tune_shape(
        6, 1, 256, 128, 2, [1], "cpu", trials=1, candidates={"decode": ("plain-split2-hq",)}, rotations=1
    )
    assert set(res["1"]["timed"]) == {"plain-split2-hq", "current"}
    assert all(r["ok"] and r["rel"] < tune_moe.TOL for r in res["1"]["timed"].values())
    assert res["1"]["best"] in res["1"]["timed"]
    card = mt.CardInfo("Tiny Test GPU", (9, 0), 4, 232448, 1e12)
    key = mt.shape_key(7, 256, 128, 3)
    with pytest.raises(Exception, match="benchmarks/tune_moe.py"):
        tune_moe.write_user_table(mt.CONFIG_DIR, card, "3.6.0", {key: {"1": res["1"]["config"]}})
    out = tmp_path / "cache"
    path = tune_moe.write_user_table(str(out), card, "3.6.0", {key: {"1": res["1"]["config"]}})
    other = mt.shape_key(9, 256, 128, 3)
    tune_moe.write_user_table(str(out), card, "3.6.0", {other: {"8": res["1"]["config"]}})  # merged, not replaced
    with open(path) as f:
        doc = json.load(f)
    assert set(doc["shapes"]) == {key, other} and doc["card"] == card.to_json()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert os.path.dirname(path) == str(out) and mt.cache_dir() != str(out)
    cfg, src = mt.tile_config(1, 7, 256, 128, 3, True, card.name, "bfloat16", card, "3.6.0", str(out))
    assert src == f"cache {os.path.basename(path)} {key}" and cfg == dict(cfg, **res["1"]["config"])
