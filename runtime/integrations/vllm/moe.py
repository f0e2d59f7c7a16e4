"""The fused MoE block under vLLM: one FusedMoE of E + S experts whose router appends the shared slots.

vLLM does the work: its ``FusedMoEFactory`` builds the experts (with the checkpoint's quantization method: FP8
128x128 block scales where vLLM has kernels for them), its runner dispatches, runs and reduces them over tensor and
expert parallel ranks. This module gives it three things:

- :class:`SharedSlotsRouter`, a vLLM router (``BaseRouter``) that routes with :func:`runtime.route` (LAYOUT section
  5: the routed top-k, then the S shared slots with weight 1.0) and numbers the slots for expert parallelism
  (:class:`.placement.SlotPlacement`: each rank holds its own replica of the shared slots);
- :func:`fused_moe_class`, the block that stands in for a family's own MoE class (``DeepseekV2MoE``, ``Glm4MoE``):
  a float32 router, the selection bias where the checkpoint has one, and no separate shared-expert MLP;
- :class:`FusedSlotLoader`, which loads the checkpoint's per-slot tensors ``experts.J.{gate,up,down}_proj`` (J up
  to E + S - 1, which vLLM's own expert mapping stops short of at E) into every global id holding slot J.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

from ...layout import (
    ActivationParams,
    GEMM1_ALPHA,
    GEMM1_BETA,
    GEMM1_CLAMP_LIMIT,
    SCALE_SUFFIX,
    LayoutError,
    read_config_block,
)
from ...routing import RoutingConfig, route
from .placement import SlotPlacement

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# experts.J.<proj>.weight / .weight_scale_inv: the layout's "proj" storage (DeepSeek and GLM sources keep it)
EXPERT_TENSOR = re.compile(
    r"^(?P<block>.+)\.experts\.(?P<slot>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight(?:"
    + re.escape(SCALE_SUFFIX)
    + ")?)$"
)
GEMM1_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<param>gemm1_alpha|gemm1_beta|gemm1_clamp_limit)$")
_SHARDS = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}
_PLAIN = ActivationParams.for_activation("swiglu")  # what vLLM's silu-and-mul computes
_SWIGLU = {GEMM1_ALPHA: _PLAIN.alpha, GEMM1_BETA: _PLAIN.beta, GEMM1_CLAMP_LIMIT: _PLAIN.clamp_limit}


class SharedSlotsRouter(BaseRouter):
    """vLLM router of one fused layer: ``runtime.route`` (Triton on CUDA, PyTorch elsewhere), then global ids.

    Args:
        cfg: the layer's :class:`runtime.RoutingConfig` (``top_k`` K routed, ``num_fused_shared_experts`` S).
        placement: the layer's :class:`.placement.SlotPlacement`.
        bias: the ``[E]`` float32 selection bias parameter, or None.
    """

    def __init__(self, cfg: RoutingConfig, placement: SlotPlacement, bias: torch.Tensor | None):
        super().__init__(top_k=cfg.slots_per_token, global_num_experts=placement.num_global)
        self.cfg, self.placement, self.bias = cfg, placement, bias

    @property
    def routing_method_type(self) -> RoutingMethodType:
        return RoutingMethodType.Custom  # no engine kernel routes this way: vLLM takes ids and weights as given

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        ids, weights = route(router_logits.float(), self.bias, self.cfg)
        ids = self.placement.to_global(ids)
        return weights, ids.to(torch.int32 if indices_type is None else indices_type)


def _refuse(where: str, what: str) -> LayoutError:
    return LayoutError(f"{where}: {what}, which the fuse-shared vLLM plugin does not run yet")


def fused_moe_class(base: type[nn.Module]) -> type[nn.Module]:
    """A MoE block class standing in for ``base`` (the family's vLLM MoE class, whose constructor it accepts), so the
    family's decoder layers and model class (which look for ``isinstance(mlp, base)``) take it as theirs."""

    class FusedSharedBlock(base):
        def __init__(self, config, parallel_config=None, quant_config=None, reduce_results=True, prefix="", **_):
            nn.Module.__init__(self)
            from vllm.config import get_current_vllm_config
            from vllm.distributed import get_ep_group

            vllm_config = get_current_vllm_config()
            parallel = parallel_config or vllm_config.parallel_config
            where = prefix or "a fused MoE layer"
            m = _LAYER.search(prefix + ".")
            if m is None:
                raise LayoutError(f"{where}: cannot tell the layer index of this MoE block from its name")
            block = read_config_block(config.to_dict())
            layer = int(m.group(1))
            own = block.for_layer(layer)
            cfg = RoutingConfig.from_config(block, layer=layer)
            if vllm_config.model_config is not None and vllm_config.model_config.dtype == torch.float16:
                raise LayoutError(
                    f"{where}: dtype float16: vLLM's DeepSeek and GLM decoder layers rescale by routed_scaling_factor "
                    "in float16 around a MoE block that scales its own routed weights; serve with --dtype bfloat16"
                )
            if cfg.hash_routed:
                raise _refuse(where, "its layer is hash-routed (DeepSeek-V4)")
            if block.routing.modality_biases:
                raise _refuse(where, "it routes with a bias per modality")
            if block.routed_format:
                raise _refuse(where, f"its routed experts are kept {block.routed_format} (layout version 3)")
            if block.activation != "swiglu":
                raise _refuse(where, f"its activation is {block.activation!r}")
            if parallel.enable_eplb:
                raise _refuse(where, "EPLB (--enable-eplb) would move slots the router numbers itself")
            if getattr(parallel, "use_sequence_parallel_moe", False):
                raise _refuse(where, "sequence-parallel MoE")
            ep = get_ep_group().world_size if parallel.enable_expert_parallel else 1
            E, S, I = own.num_routed_experts, own.num_fused_shared_experts, own.expert_intermediate_size  # noqa: E741
            self.placement = SlotPlacement(E, S, ep)
            N = self.placement.num_global
            # what the family's model class reads off its MoE layers (vLLM's MixtureOfExperts interface)
            self.n_routed_experts, self.n_shared_experts = E, S
            self.n_logical_experts = self.n_physical_experts = N
            self.n_local_physical_experts, self.n_redundant_experts = N // ep, 0
            self.routed_scaling_factor = 1.0  # route() scales the routed weights itself
            self.gate = GateLinear(
                config.hidden_size, E, out_dtype=torch.float32, params_dtype=torch.float32, prefix=f"{prefix}.gate"
            )
            bias = None
            if block.routing.has_bias:
                bias = self.gate.e_score_correction_bias = nn.Parameter(
                    torch.empty(E, dtype=torch.float32), requires_grad=False
                )
            else:
                self.gate.e_score_correction_bias = None
            self.experts = FusedMoEFactory(
                num_experts=N,
                top_k=cfg.slots_per_token,
                hidden_size=config.hidden_size,
                intermediate_size=I,
                renormalize=False,
                quant_config=quant_config,
                prefix=f"{prefix}.experts",
                router=SharedSlotsRouter(cfg, self.placement, bias),
                reduce_results=reduce_results,
                router_logits_dtype=torch.float32,
            )

        def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            shape = hidden_states.shape
            h = hidden_states.reshape(-1, shape[-1])
            logits, _ = self.gate(h)
            return self.experts(hidden_states=h, router_logits=logits).reshape(shape)

    FusedSharedBlock.__name__ = FusedSharedBlock.__qualname__ = "FusedShared" + base.__name__
    return FusedSharedBlock


class FusedSlotLoader:
    """Loads a converted checkpoint's per-slot expert tensors into the fused blocks of one vLLM model.

    Args:
        model: the vLLM model (its fused blocks are those with a ``placement``).
    """

    def __init__(self, model: nn.Module):
        self.blocks = {
            name: m for name, m in model.named_modules() if isinstance(getattr(m, "placement", None), SlotPlacement)
        }
        self.loaded: set[str] = set()

    def split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """``weights`` less the tensors of the fused blocks, which are loaded here as they pass."""
        for name, tensor in weights:
            m = EXPERT_TENSOR.match(name) or GEMM1_TENSOR.match(name)
            if m is None or m.group("block") not in self.blocks:
                yield name, tensor  # a dense layer, an MTP layer vLLM skips, every other tensor: the model's own loader
                continue
            block = self.blocks[m.group("block")]
            if "param" in m.groupdict():
                self._check_swiglu(name, m.group("param"), tensor)
                continue
            param_base, shard = _SHARDS[m.group("proj")]
            routed = block.experts.routed_experts
            attr = f"{param_base}_{m.group('kind')}"
            param = getattr(routed, attr, None)
            if param is None:
                raise LayoutError(
                    f"{name}: the vLLM experts of {m.group('block')} have no {attr} (a "
                    f"{'block-scaled FP8' if m.group('kind').endswith(SCALE_SUFFIX) else 'float'} tensor where vLLM "
                    "built the other kind)"
                )
            for expert_id in block.placement.global_ids(int(m.group("slot"))):
                routed.weight_loader(param, tensor, name, shard, expert_id)
            self.loaded.add(f"{m.group('block')}.experts.routed_experts.{attr}")

    @staticmethod
    def _check_swiglu(name: str, param: str, tensor: torch.Tensor) -> None:
        if not torch.all(tensor.float() == _SWIGLU[param]):
            raise LayoutError(f"{name}: per-slot SwiGLU parameters other than plain SwiGLU's, which vLLM does not run")

    def check_complete(self, model: nn.Module) -> None:
        """Every fused block's expert parameters got a tensor."""
        for prefix in self.blocks:
            want = {f"{prefix}.experts.{n}" for n, _ in self.blocks[prefix].experts.named_parameters()}
            missing = sorted(
                n for n in want if n.rsplit(".", 1)[-1].startswith(("w13_", "w2_")) and n not in self.loaded
            )
            if missing:
                raise LayoutError(f"the checkpoint gave no tensors for {', '.join(missing)}")
