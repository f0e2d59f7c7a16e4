"""resolve_model_source / convert from a Hub repo id, against the loopback fake Hub."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from fake_hub import BOB_TOKEN, WRITE_TOKEN
from fuse_tool.hub import HubError, is_hub_reference, parse_hub_reference, resolve_model_source

pytestmark = pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")

SRC = "alice/tiny-dsv3"
WANTED = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "configuration_tiny.py",
}
UNWANTED = {"README.md", "extra/pytorch_model.bin", "onnx/model.onnx", "logs/events.out.tfevents.1"}


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 checkpoint written by transformers (4 shards), plus tokenizer files and junk."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("src") / "tiny-dsv3"
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="300KB")
    (path / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}})
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "configuration_tiny.py").write_text("# remote code\n")
    (path / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    for junk in ("extra/pytorch_model.bin", "onnx/model.onnx", "logs/events.out.tfevents.1"):
        (path / junk).parent.mkdir(parents=True, exist_ok=True)
        (path / junk).write_bytes(os.urandom(1000))
    return path


def _shards(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.name.endswith(".safetensors")}


@pytest.fixture
def src_repo(hub, source_dir):
    """SRC on the fake Hub, uploaded with the real client; returns the local folder it came from."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(SRC, exist_ok=True)
    api.upload_folder(repo_id=SRC, folder_path=source_dir)
    hub.reset_log()
    return source_dir


def test_is_hub_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "local").mkdir(parents=True)
    assert is_hub_reference("deepseek-ai/DeepSeek-V3")
    assert is_hub_reference("deepseek-ai/DeepSeek-V3@main")
    assert is_hub_reference("moonshotai/Kimi-K2-Instruct@0123456789abcdef0123456789abcdef01234567")
    assert not is_hub_reference("owner/local")  # exists locally
    assert not is_hub_reference(str(tmp_path))
    assert not is_hub_reference("./a/b")
    assert not is_hub_reference("/abs/path")
    assert not is_hub_reference("just-a-name")
    assert not is_hub_reference("a/b/c")
    assert parse_hub_reference("o/n@v1.0") == ("o/n", "v1.0")
    assert parse_hub_reference("o/n") == ("o/n", None)


def test_local_folder_returned_unchanged(hub, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    assert resolve_model_source(d) == d
    assert resolve_model_source(str(d)) == d
    assert hub.api_requests() == []


def test_download_fetches_only_what_conversion_needs(hub, src_repo):
    from huggingface_hub import constants

    path = resolve_model_source(SRC, progress=False)
    cache = Path(constants.HF_HUB_CACHE) / "models--alice--tiny-dsv3"
    head = hub.head(SRC).id
    assert path == cache / "snapshots" / head

    got = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert got == WANTED | _shards(src_repo)
    assert not (UNWANTED & got)
    for rel in got:
        p = path / rel
        assert p.is_symlink() and Path(os.path.realpath(p)).parent == cache / "blobs", rel  # read in place from blobs
        assert p.read_bytes() == (src_repo / rel).read_bytes(), rel
    assert {r for _, r in hub.download_log} == got  # nothing else was fetched


def test_download_rerun_fetches_only_missing(hub, src_repo):
    path = resolve_model_source(SRC, progress=False)
    hub.reset_log()
    assert resolve_model_source(SRC, progress=False) == path
    assert hub.download_log == []  # all cached: no file body fetched again

    victim = sorted(_shards(src_repo))[1]
    blob = Path(os.path.realpath(path / victim))
    (path / victim).unlink()
    blob.unlink()
    resolve_model_source(SRC, progress=False)
    assert hub.download_log == [(SRC, victim)]
    assert (path / victim).read_bytes() == (src_repo / victim).read_bytes()


def test_download_at_revision(hub, src_repo):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_branch(SRC, branch="v2")
    cfg = json.loads((src_repo / "config.json").read_text())
    assert cfg["routed_scaling_factor"] != 1.5
    cfg["routed_scaling_factor"] = 1.5
    api.upload_file(path_or_fileobj=json.dumps(cfg).encode(), path_in_repo="config.json", repo_id=SRC, revision="v2")
    v2 = hub.head(SRC, "v2").id

    path = resolve_model_source(f"{SRC}@v2", progress=False)
    assert path.name == v2
    assert json.loads((path / "config.json").read_text())["routed_scaling_factor"] == 1.5
    main = resolve_model_source(SRC, progress=False)
    assert json.loads((main / "config.json").read_text()) == json.loads((src_repo / "config.json").read_text())
    assert main != path
    by_sha = resolve_model_source(f"{SRC}@{v2}", progress=False)
    assert by_sha == path


def test_offline_uses_cache_and_refuses_otherwise(hub, src_repo, monkeypatch):
    from huggingface_hub import constants

    path = resolve_model_source(SRC, progress=False)
    hub.reset_log()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_source(SRC, progress=False) == path
    assert hub.api_requests() == []
    with pytest.raises(HubError) as ei:
        resolve_model_source("alice/never-downloaded", progress=False)
    msg = str(ei.value)
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in msg and "alice/never-downloaded" in msg
    assert hub.api_requests() == []


def test_repo_not_found(hub):
    with pytest.raises(HubError) as ei:
        resolve_model_source("alice/does-not-exist", progress=False)
    msg = str(ei.value)
    assert msg.startswith("alice/does-not-exist not found on " + hub.url) and "no local folder" in msg


def test_private_repo_without_access(hub, src_repo, monkeypatch):
    hub.repos[SRC].private = True
    monkeypatch.setenv("HF_TOKEN", BOB_TOKEN)
    with pytest.raises(HubError) as ei:
        resolve_model_source(SRC, progress=False)
    assert "not found" in str(ei.value) and "private" in str(ei.value)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    assert resolve_model_source(SRC, progress=False).is_dir()


def test_revision_not_found(hub, src_repo):
    with pytest.raises(HubError) as ei:
        resolve_model_source(f"{SRC}@no-such-branch", progress=False)
    assert str(ei.value) == f"revision 'no-such-branch' not found in {SRC} on {hub.url}"


@pytest.mark.parametrize("bad", ["alice/bad--name", "alice/x..y", "alice/-x", "alice/x@"])
def test_malformed_repo_id(hub, bad):
    with pytest.raises(HubError) as ei:
        resolve_model_source(bad, progress=False)
    assert str(ei.value).startswith(("malformed repo id", "malformed Hub reference")), str(ei.value)
    assert hub.api_requests() == []


def test_not_a_folder_nor_a_repo_id(hub, tmp_path):
    with pytest.raises(HubError) as ei:
        resolve_model_source(str(tmp_path / "nope"), progress=False)
    assert "no such local folder" in str(ei.value)


def test_network_unreachable(hub, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(HubError) as ei:
        resolve_model_source(SRC, progress=False)
    msg = str(ei.value)
    assert msg.startswith(f"cannot reach the Hub at {dead}"), msg


def test_repo_without_safetensors(hub, tmp_path):
    from huggingface_hub import HfApi

    d = tmp_path / "bin-only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\0" * 100)
    HfApi().create_repo("alice/bin-only")
    HfApi().upload_folder(repo_id="alice/bin-only", folder_path=d)
    with pytest.raises(HubError) as ei:
        resolve_model_source("alice/bin-only", progress=False)
    assert "no .safetensors" in str(ei.value)


def _convert_checkpoint():
    try:
        from fuse_tool.convert import convert_checkpoint
    except ImportError:
        pytest.skip("fuse_tool.convert.convert_checkpoint does not exist yet")
    return convert_checkpoint


def test_convert_from_repo_id(hub, src_repo, tmp_path):
    """Download a source from the Hub, convert it from the cache in place, check and push the result."""
    convert_checkpoint = _convert_checkpoint()
    from fuse_tool.hub import push_checkpoint
    from fuse_tool.verify.integrity import check_output

    path = resolve_model_source(SRC, progress=False)
    out = tmp_path / "out"
    convert_checkpoint(path, out, progress=False, source_id=SRC)
    checked = check_output(out, checksums=True)
    assert checked.block.num_routed_experts == 8 and checked.block.num_fused_shared_experts == 1
    assert checked.block.moe_layers == (1, 2)
    assert (out / "tokenizer.json").read_bytes() == (src_repo / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()

    push_checkpoint(out, "alice/tiny-dsv3-fused", progress=False)
    card = hub.file_bytes("alice/tiny-dsv3-fused", "README.md").decode()
    assert re.search(r"base_model:\n- \"alice/tiny-dsv3\"", card)


def test_cli_convert_from_repo_id_with_push_to(hub, src_repo, tmp_path):
    """`fuse-shared convert OWNER/NAME OUT --push-to REPO` end to end (the CLI belongs to the converter)."""
    _convert_checkpoint()
    from click.testing import CliRunner

    from fuse_tool.cli import main

    out = tmp_path / "cli-out"
    res = CliRunner().invoke(main, ["convert", SRC, str(out), "--push-to", "alice/tiny-cli", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "pushed" in res.output
    assert hub.file_bytes("alice/tiny-cli", "config.json") == (out / "config.json").read_bytes()
    assert WRITE_TOKEN not in res.output

    res = CliRunner().invoke(main, ["push", str(out), "alice/bad--name"])
    assert res.exit_code == 1 and "error: malformed repo id" in res.output


def test_verify_against_accepts_a_hub_id(hub, src_repo, tmp_path):
    """`verify OUT --against OWNER/NAME`: MODEL is a folder or a Hub id, as for convert."""
    _convert_checkpoint()
    from click.testing import CliRunner

    from fuse_tool.cli import main

    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["convert", SRC, str(out), "--quiet"]).exit_code == 0
    res = CliRunner().invoke(main, ["verify", str(out), "--quiet", "--against", SRC, "--tokens", "1x8"])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
