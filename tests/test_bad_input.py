"""Bad input: one clear line naming the file and tensor, exit 1, and nothing in OUT_DIR."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from builders import build_checkpoint, load_all, rewrite, to_fp8_block
from fuse_tool.cli import main
from runtime.families import describe_model


@pytest.fixture()
def src(tmp_path):
    return build_checkpoint("deepseek_v3", tmp_path / "src")


def run_convert(model, out, *extra):
    r = CliRunner().invoke(main, ["convert", str(model), str(out), "--quiet", *extra])
    return r.exit_code, r.output


def assert_refused(code, output, out_dir, *fragments):
    assert code == 1, output
    assert output.startswith("error: ") and "Traceback" not in output
    for f in fragments:
        assert f in output, f"{f!r} not in {output!r}"
    assert not out_dir.exists() or not any(p for p in out_dir.iterdir() if not p.name.startswith(".")), (
        "nothing final-named in OUT_DIR"
    )


def mutate(src, fn):
    t = load_all(src)
    fn(t)
    rewrite(src, t)


def test_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(*run_convert(tmp_path / "empty", tmp_path / "out"), tmp_path / "out", "no config.json")


def test_corrupt_header(src, tmp_path):
    f = next(src.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[8:20] = b"{not json!!!"
    f.write_bytes(bytes(data))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", f.name, "header is not valid JSON")


def test_missing_tensor(src, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    mutate(src, lambda t: t.pop(name))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", name, "missing", "expected shape [32, 64]")


def test_wrong_shape(src, tmp_path):
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"
    mutate(src, lambda t: t.__setitem__(name, torch.zeros(64, 16, dtype=torch.bfloat16)))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", name, "has shape [64, 16], expected [64, 32]")


def test_wrong_dtype(src, tmp_path):
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    mutate(src, lambda t: t.__setitem__(name, torch.zeros(32, 64, dtype=torch.int32)))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", name, "dtype I32")


def test_fp8_weight_without_scale(src, tmp_path):
    to_fp8_block(src)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    mutate(src, lambda t: t.pop(name + "_scale_inv"))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", name, "FP8 weight without its scale")


def test_mxfp8_with_a_bad_scale_shape_is_refused(src, tmp_path):
    """A U8 scale per 1x32 group that does not cover the weight's inputs is read neither as MXFP8 nor as 128x128
    blocks."""
    to_fp8_block(src)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"

    def to_mx(t):
        rows, cols = t[name].shape
        t[name + "_scale_inv"] = torch.full((rows, -(-cols // 32) + 1), 127, dtype=torch.uint8)

    mutate(src, to_mx)
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", name + "_scale_inv")


def test_shared_and_routed_formats_differ(src, tmp_path):
    to_fp8_block(src)
    sh = "model.layers.1.mlp.shared_experts"

    def dequant_shared(t):
        for p in ("gate_proj", "up_proj", "down_proj"):
            n = f"{sh}.{p}.weight"
            t[n] = torch.zeros(t[n].shape, dtype=torch.bfloat16)
            t.pop(n + "_scale_inv")

    mutate(src, dequant_shared)
    assert_refused(
        *run_convert(src, tmp_path / "out"),
        tmp_path / "out",
        f"{sh}.gate_proj.weight",
        "shared and routed experts must share one format",
    )


def test_out_dir_not_empty(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = run_convert(src, out)
    assert code == 1 and "not empty" in output and "--overwrite" in output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_out_dir_inside_model_dir(src):
    out = src / "converted"
    code, output = run_convert(src, out)
    assert code == 1 and "inside it" in output and not out.exists()


def test_config_contradicts_tensors(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["first_k_dense_replace"] = 2  # layer 1 has experts but would be dense
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", "layer 1 dense", "but it has expert tensors")


def test_more_experts_than_config(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["n_routed_experts"] = 6
    (src / "config.json").write_text(json.dumps(cfg))
    code, output = run_convert(src, tmp_path / "out")
    assert_refused(code, output, tmp_path / "out", "model.layers.1.mlp.gate.weight", "expected [6, H]")


def test_expert_beyond_the_config_is_refused(src, tmp_path):
    """An expert id >= E under a MoE block (router and config agree on E = 8) is named, with the count the config gives."""
    extra = "model.layers.2.mlp.experts.8.up_proj.weight"
    mutate(src, lambda t: t.__setitem__(extra, t["model.layers.2.mlp.experts.0.up_proj.weight"].clone()))
    assert_refused(
        *run_convert(src, tmp_path / "out"),
        tmp_path / "out",
        extra,
        "config.json says 8 routed experts, but the checkpoint has expert 8",
    )


def test_unknown_tensor_in_a_moe_block_is_refused(src, tmp_path):
    extra = "model.layers.1.mlp.router_temperature"
    mutate(src, lambda t: t.__setitem__(extra, torch.ones(1, dtype=torch.bfloat16)))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", extra, "unexpected tensor in MoE layer 1")


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("minimax_m2", "has no shared expert"),
        ("qwen2_moe", "per-token sigmoid gate"),
        ("qwen3_next", "per-token sigmoid gate"),
        ("qwen3_5_moe", "per-token sigmoid gate"),
        ("llama4", "scales the expert input"),
        ("qwen4_exp", "per-token sigmoid gate"),
        ("qwen4_exp_text", "per-token sigmoid gate"),
        ("nemotron_h", "ReLU² MLPs"),
        ("nemotron_h", "latent space"),
        ("longcat_flash", "zero-computation experts"),
        ("longcat_flash", "no shared expert"),
        ("mimo_v2_flash", "no shared expert"),
        ("gpt_oss", "no shared expert"),
        (
            "mixtral",
            "not supported; supported: afmoe, aria, aria_text, axk2, bailing_hybrid, cohere2_moe, deepseek_ocr2, deepseek_v2",
        ),
        # transformers 5.25's shared-expert families that are not fused (issue 22): each names what stands in the way.
        ("qwen3_omni_moe", "per-token sigmoid gate"),
        ("qwen3_omni_moe_thinker", "no shared expert"),
        ("inkling_mm_model", "per-token router weight"),
        ("ergo", "ungated MLP"),
        ("ernie4_5_vl_moe", "separate routed expert sets"),
        ("axk1", "post_mlp_layernorm"),
        ("step3p5", "convert the step3p7 checkpoint"),
    ],
)
def test_refused_model_types(src, tmp_path, model_type, reason):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = model_type
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", reason)


@pytest.mark.parametrize(
    "model_type,fields,reason",
    [
        ("cohere2_moe", {}, "no shared expert in this config"),  # transformers' default num_shared_experts 0
        ("cohere2_moe", {"num_shared_experts": 1}, "averaged"),  # the default combination strategy halves both
        ("granitemoe_swa", {}, "no shared expert in this config"),
        # a dense Granite 4.0: no layer has routed experts, every layer runs its shared MLP alone
        ("granitemoehybrid", {"num_local_experts": 0}, "num_local_experts is 0, so no layer has routed experts"),
    ],
)
def test_config_dependent_refusals(src, tmp_path, model_type, fields, reason):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type=model_type, **fields)
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", reason)


def test_wrapper_of_a_refused_family_is_refused_with_its_reason(src, tmp_path):
    """A vision or audio wrapper fuse-shared has never seen, around a known text family, is that family."""
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "qwen2_moe"
    (src / "config.json").write_text(json.dumps({"model_type": "some_future_vl", "text_config": text}))
    assert_refused(
        *run_convert(src, tmp_path / "out"),
        tmp_path / "out",
        "'some_future_vl' wraps a Qwen2-MoE",
        "per-token sigmoid gate",
    )


@pytest.mark.parametrize("model_type", [[], {"a": 1}, 3])
def test_a_wrapper_whose_model_type_is_not_a_string_is_refused_in_one_line(src, tmp_path, model_type):
    """Found by the config fuzzer: a list as the outer model_type of a config with a text_config crashed the wrapper
    lookup (an unhashable registry key) instead of being refused, naming the field."""
    text = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": text}))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", "model_type")


def test_wrapper_of_a_fused_family_is_described_as_that_family(src):
    text = json.loads((src / "config.json").read_text())
    arch = describe_model({"model_type": "some_future_vl", "text_config": text, "vision_config": {"depth": 1}})
    plain = describe_model(text)
    assert (arch.family, arch.model_type, arch.config_key) == (plain.family, "some_future_vl", "text_config")
    assert arch.layer_prefix == "model.language_model.layers." and plain.layer_prefix == "model.layers."
    assert (arch.moe_layers, arch.num_routed_experts, arch.shared_width, arch.routing) == (
        plain.moe_layers,
        plain.num_routed_experts,
        plain.shared_width,
        plain.routing,
    )


def test_minimax_m3_without_shared_width_is_refused(tmp_path):
    src = build_checkpoint("minimax_m3_text", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["shared_intermediate_size"] = 0
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", "no shared expert")


def test_latent_routed_experts_refused_in_any_family(src, tmp_path):
    """The general rule: routed experts in a latent space narrower than the hidden size, whatever the model_type."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_latent_size"] = cfg["hidden_size"] // 2
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(
        *run_convert(src, tmp_path / "out"),
        tmp_path / "out",
        "moe_latent_size",
        "latent space",
        "narrower than the hidden size",
    )


@pytest.mark.parametrize("family,flag", [("hy_v3", "mlp_bias"), ("ernie4_5_moe", "use_bias")])
def test_shared_mlp_with_biases_is_refused(tmp_path, family, flag):
    src = build_checkpoint(family, tmp_path / "src", experts=6, **{flag: True})
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", flag, "no bias terms")


@pytest.mark.parametrize(
    "family,fields,reason",
    [
        ("laguna", {"moe_apply_router_weight_on_input": True}, "scales the expert input"),
        ("exaone_moe", {"is_moe_layer": [False, False, True]}, "transformers builds MoE blocks in layers [1, 2]"),
        ("axk2", {"n_group": 2, "topk_group": 1}, "score of 0.0, not -inf"),
    ],
)
def test_unfusable_variants_of_new_families_are_refused(tmp_path, family, fields, reason):
    src = build_checkpoint(family, tmp_path / "src", experts=6)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **fields}))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", next(iter(fields)), reason)


def test_granitemoeshared_without_shared_width_is_refused(tmp_path):
    src = build_checkpoint("granitemoeshared", tmp_path / "src", experts=6)
    cfg = json.loads((src / "config.json").read_text())
    cfg["shared_intermediate_size"] = 0
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", "no shared expert", "nothing to fuse")


def test_hunyuan_per_layer_expert_counts_must_agree(tmp_path):
    src = build_checkpoint("hunyuan_v1_moe", tmp_path / "src", experts=7)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = [7, 7, 5]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(
        *run_convert(src, tmp_path / "out"), tmp_path / "out", "num_experts", "one E and one top-k per checkpoint"
    )
    cfg["num_experts"] = [7, 7, 7]  # every layer agrees: converted as E = 7
    (src / "config.json").write_text(json.dumps(cfg))
    code, output = run_convert(src, tmp_path / "out2")
    assert code == 0, output


@pytest.mark.parametrize("limit", [0, -1.5])
def test_hy_v4_with_a_limit_transformers_documents_and_applies_differently_is_refused(tmp_path, limit):
    src = build_checkpoint("hy_v4", tmp_path / "src", experts=6)
    cfg = json.loads((src / "config.json").read_text())
    cfg["swiglu_limit"] = limit
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(
        *run_convert(src, tmp_path / "out"), tmp_path / "out", "swiglu_limit", "documents a limit <= 0 as 'no clamp'"
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(mlp_bias=True), "no bias terms"),
        (dict(swiglu_limits=[0, -0.3, 0.25]), "entry 1 is -0.3, expected null or a number >= 0"),
        (dict(swiglu_limits_shared=[0, None]), "expected a list of 3 limits"),
    ],
)
def test_step3p7_config_refusals(tmp_path, change, message):
    src = build_checkpoint("step3p7", tmp_path / "src", experts=6)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(*run_convert(src, tmp_path / "out"), tmp_path / "out", f"text_config.{next(iter(change))}", message)


@pytest.mark.parametrize("model", ["examples/tiny-deepseek-v4x", "./tiny-x", "/nonexistent/tiny-x", "../tiny-x"])
def test_mistyped_local_path_says_no_such_folder_without_asking_the_hub(model, tmp_path, monkeypatch):
    """A name that looks like a path (``examples/`` exists here) is never sent to the Hub as a repo id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a Hub request would fail with "cannot reach"
    for command in (["convert", model, str(tmp_path / "out"), "--quiet"], ["inspect", model]):
        r = CliRunner().invoke(main, command)
        assert r.exit_code == 1 and "no such folder" in r.output and "Hub is not asked" in r.output, r.output
        assert "cannot reach" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out").exists()


def test_huge_model_argument_is_quoted_bounded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["inspect", "x" * 100_000])
    assert r.exit_code == 1 and len(r.output) < 1200 and "characters cut" in r.output, r.output[:300]


def test_huge_model_type_is_quoted_bounded(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "m" * 10_000_000
    (src / "config.json").write_text(json.dumps(cfg))
    code, output = run_convert(src, tmp_path / "out")
    assert code == 1 and len(output) < 1200 and "characters cut" in output and "Traceback" not in output, output[:300]


@pytest.mark.parametrize("command", ["convert", "verify"])
@pytest.mark.parametrize(
    "device,message",
    [
        (
            "cuda",
            "'cuda': this torch (" + torch.__version__ + ") is built without CUDA: pass cpu, or install a CUDA build",
        ),
        ("gpu", "'gpu' is not a device: pass cpu, cuda or cuda:N"),
    ],
)
def test_device_without_cuda_is_one_line_saying_what_to_pass(src, tmp_path, monkeypatch, command, device, message):
    """``--device cuda`` where torch has no CUDA, or a malformed device: one line naming the option and what to pass,
    before any work (before: convert's 'no CUDA device is available' for 'cuda:x' too, verify's torch assertion
    'Torch not compiled with CUDA enabled' after loading)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    out = tmp_path / "out"
    args = [str(src), str(out)] if command == "convert" else [str(src), "--against", str(src)]
    r = CliRunner().invoke(main, [command, *args, "--device", device])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith(f"error: Invalid value for '--device': {message}"), lines[0]
    assert not out.exists()


def test_a_missing_optional_package_is_not_called_a_bug(capsys):
    """An ImportError reaching the command line is the user's setup: one line naming what to install."""
    from fuse_tool.cli import _fail

    for e, want in [
        (
            ModuleNotFoundError("No module named 'transformers'", name="transformers"),
            "pip install 'fuse-shared[verify]'",
        ),
        (ModuleNotFoundError("No module named 'triton.language'", name="triton.language"), "pip install triton"),
        (ImportError("serving needs transformers, which is not installed: pip install 'fuse-shared[verify]'"), None),
    ]:
        with pytest.raises(SystemExit) as ex:
            _fail(e)
        err = capsys.readouterr().err.strip()
        assert ex.value.code == 1 and "bug" not in err and len(err.splitlines()) == 1, err
        assert err == f"error: {e}" if want is None else err.endswith(f"which is not installed: {want}"), err


# Kimi-K3's config as released (model_type kimi_k3 around a Kimi-Linear text model; the fields the refusal reads, from
# public reconciliations of the official config.json): routed experts at routed_expert_hidden_size 3584 of a 7168
# hidden size, and routed experts compressed-tensors mxfp4-pack-quantized, a format no module here reads.
KIMI_K3 = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "weights": {"group_size": 32, "num_bits": 4}}},
    },
    "text_config": {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "num_expert_group": 1,
        "topk_group": 1,
    },
}


@pytest.mark.parametrize("model_type", ["kimi_k3", "some_kimi_k3_like_wrapper"])
def test_kimi_k3_is_refused_for_its_latent_experts_not_its_format(src, tmp_path, model_type):
    """Before, Kimi-K3 was described as Kimi-Linear and then refused for 'mxfp4-pack-quantized', which says nothing of
    why it cannot be fused: its routed experts run at 3584 of a 7168 hidden size. The structure is named, under its own
    family or, for a wrapper no family claims, under the rule every family goes through."""
    (src / "config.json").write_text(json.dumps({**KIMI_K3, "model_type": model_type}))
    code, output = run_convert(src, tmp_path / "out")
    assert_refused(code, output, tmp_path / "out", "routed_expert_hidden_size = 3584", "narrower than the hidden size")
    assert "mxfp4" not in output and "not supported" not in output
    if model_type == "kimi_k3":
        assert "model_type 'kimi_k3' (Kimi-K3) cannot be converted" in output
