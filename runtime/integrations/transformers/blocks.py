"""The MoE block that stock transformers loads a converted layer into (:class:`LoadedFusedSharedMoE`).

:class:`runtime.FusedSharedMoE` holds its experts as an :class:`runtime.ExpertWeights` read by the project's own
loader. This block is the same layer (same routing, :func:`runtime.moe.route_rows`, same :func:`runtime.fused_moe`)
whose tensors are parameters under the names transformers' loader gives the checkpoint's tensors (``gate.weight``,
``experts.gate_up_proj``, ``experts.gate_up_proj_scale_inv``, ...), so ``from_pretrained`` fills it tensor by tensor,
on the device its ``device_map`` says, and accelerate's hooks can move or offload it like any module. It is built on
the meta device by :mod:`.quantizer`; torch only (no transformers import).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Mapping

import torch

from ...moe import ExpertWeights, FusedSharedMoE
from ...routing import RoutingConfig, check_hash_table, check_selection_bias

# The tensors of one block, by role. gate_up / down are required; the rest are optional.
ROLES = (
    "router",  # [E, H] float32
    "bias",  # [E] or [1, E] float32 selection bias
    "hash_table",  # [vocab, K] int64 (hash-routed layers)
    "gate_up",  # [E+S, 2I, H] FP8 e4m3 or float (gate rows first)
    "gate_up_scale",  # [E+S, 2*ceil(I/128), ceil(H/128)] float32
    "down",  # [E+S, H, I]
    "down_scale",  # [E+S, ceil(H/128), ceil(I/128)] float32
    "gemm1_alpha",  # [E+S] float32
    "gemm1_beta",
    "gemm1_clamp_limit",
)


class NoSharedMLP(torch.nn.Module):
    """Stands for a shared MLP whose slots are in the layer's fused block: adds nothing (zeros of its input's shape).
    Decoder layers that run their shared MLP unconditionally (GraniteMoE-Hybrid) call it; those that skip a None one
    (GraniteMoE-Shared) add exact zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


@dataclass(frozen=True)
class BlockTensor:
    """One tensor of a block: its name inside the block (``"experts.gate_up_proj"``), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# What the ``experts`` child answers for the whole block (ExpertWeights' fields and properties).
_EXPERT_ATTRIBUTES = {f.name for f in fields(ExpertWeights)} | {
    n for n, v in vars(ExpertWeights).items() if isinstance(v, property)
}


_ROUTING_ATTRIBUTES = ("router_weight", "e_score_correction_bias", "tid2eid")  # routing_tensors(), in order


class _ExpertsModule(torch.nn.Module):
    """The block's ``experts`` child: it holds the expert parameters transformers names ``experts.*``, and answers
    what :class:`runtime.ExpertWeights` answers (``num_expert_slots``, ``is_fp8``, ``gate_up``, ...) for the whole
    block, as :attr:`runtime.FusedSharedMoE.experts` does."""

    def __init__(self, owner: "LoadedFusedSharedMoE"):
        super().__init__()
        object.__setattr__(self, "_owner", weakref.ref(owner))  # not a child module: no cycle in the module tree

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            owner = object.__getattribute__(self, "_owner")()
            if owner is None or name not in _EXPERT_ATTRIBUTES:
                raise
            try:
                weights = owner.expert_weights()
            except (KeyError, ValueError):  # the block is still being built
                raise AttributeError(name) from None
            return getattr(weights, name)


class LoadedFusedSharedMoE(FusedSharedMoE):
    """A converted MoE layer whose tensors are module parameters under transformers' names (see the module docstring).

    Args:
        cfg: the layer's routing (:meth:`runtime.RoutingConfig.from_config` for its layer).
        activation: the block's SwiGLU form (``layout.ACTIVATIONS``).
        tensors: ``{role: BlockTensor}`` for the roles in :data:`ROLES` the layer has (``gate_up``, ``down``,
            ``router`` and the three ``gemm1_*`` always; scales with FP8 experts).
        modality_biases: ``BlockTensor`` s of the extra selection biases ``[E]`` (LAYOUT v4 ``routing.modality_biases``).
        backend: as :class:`runtime.FusedSharedMoE`.

    Parameters are created on the current default device (the quantizer builds it under ``torch.device("meta")``);
    :meth:`forward` is :class:`runtime.FusedSharedMoE`'s, over :meth:`expert_weights` built from the parameters at each
    call (views, no copy). ``experts`` is always a child module (:class:`_ExpertsModule`).
    """

    def __init__(
        self,
        cfg: RoutingConfig,
        activation: str,
        tensors: Mapping[str, BlockTensor],
        modality_biases: tuple[BlockTensor, ...] = (),
        backend: str | None = None,
    ):
        torch.nn.Module.__init__(self)  # FusedSharedMoE's own __init__ takes loaded tensors; these come later
        unknown = set(tensors) - set(ROLES)
        missing = {"router", "gate_up", "down"} - set(tensors)
        if unknown or missing:
            raise ValueError(f"block tensors: unknown roles {sorted(unknown)}, missing {sorted(missing)}")
        self.cfg, self.backend, self.activation = cfg, backend, activation
        self._names = {role: t.name for role, t in tensors.items()}
        self._modality_names = tuple(t.name for t in modality_biases)
        self._dtypes = {t.name: t.dtype for t in list(tensors.values()) + list(modality_biases)}
        self.add_module("experts", _ExpertsModule(self))
        for t in list(tensors.values()) + list(modality_biases):
            parent, _, leaf = t.name.rpartition(".")
            holder = self
            for part in parent.split(".") if parent else ():
                if part not in holder._modules:
                    holder.add_module(part, torch.nn.Module())
                holder = holder._modules[part]
            value = torch.empty(t.shape, dtype=t.dtype)
            if t.dtype.is_floating_point:
                holder.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
            else:
                holder.register_buffer(leaf, value)  # the int64 hash table

    def _tensor(self, name: str) -> torch.Tensor:
        mod = self
        *path, leaf = name.split(".")
        for part in path:
            mod = mod._modules[part]
        t = mod._parameters.get(leaf)
        return mod._buffers[leaf] if t is None else t

    def _get(self, role: str) -> torch.Tensor | None:
        name = self._names.get(role)
        return None if name is None else self._tensor(name)

    def routing_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(router_weight [E, H] float32, bias, tid2eid)``: the bias ``[E]`` (or ``[1, E]``), or the ``[M, E]`` stack
        with the modality biases, float32, None for none and on hash-routed layers (bias-free); ``tid2eid`` on
        hash-routed layers only."""
        router = self._get("router").to(torch.float32)
        bias = self._get("bias")
        if bias is not None and self.cfg.hash_routed:
            bias = None
        elif bias is not None and self._modality_names:
            rows = [self._tensor(n).reshape(-1) for n in self._modality_names]
            bias = torch.stack([bias.reshape(-1), *rows])
        bias = None if bias is None else bias.to(torch.float32)
        return router, bias, self._get("hash_table") if self.cfg.hash_routed else None

    def __getattr__(self, name: str):
        # FusedSharedMoE's router_weight / e_score_correction_bias / tid2eid, unless a parameter of the block carries
        # that name (Hunyuan 3's bias is the block's own e_score_correction_bias): then it is that parameter
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in _ROUTING_ATTRIBUTES:
                raise
            try:
                tensors = self.routing_tensors()
            except KeyError:  # the block is still being built
                raise AttributeError(name) from None
            return tensors[_ROUTING_ATTRIBUTES.index(name)]

    def __setattr__(self, name: str, value) -> None:
        # ``moe.experts = ExpertWeights(...)`` swaps the slots the block runs, as on a FusedSharedMoE (tests dequantize
        # them so); the loaded parameters stay as they are
        if name == "experts" and isinstance(value, ExpertWeights):
            self.__dict__["_swapped_experts"] = value
        else:
            super().__setattr__(name, value)

    def expert_weights(self) -> ExpertWeights:
        """The layer's E+S slots over the parameters (checked as :class:`runtime.ExpertWeights` checks them), or the
        ones assigned to ``experts``."""
        if "_swapped_experts" in self.__dict__:
            return self.__dict__["_swapped_experts"]
        g = self._get
        return ExpertWeights(
            g("gate_up"),
            g("down"),
            g("gate_up_scale"),
            g("down_scale"),
            g("gemm1_alpha"),
            g("gemm1_beta"),
            g("gemm1_clamp_limit"),
            self.activation,
        )

    def check_loaded(self, where: str) -> None:
        """Raise ValueError naming ``where`` when the loaded tensors do not make the layer built (a dtype the loader
        changed, a bias or hash table of the wrong shape)."""
        try:
            for name, dtype in self._dtypes.items():
                t = self._tensor(name)
                if t.dtype != dtype:  # (a tensor accelerate offloaded to disk stays on meta until its forward)
                    raise ValueError(f"{name} was loaded as {t.dtype}, expected {dtype}")
            ex = self.expert_weights()
            if ex.num_expert_slots != self.cfg.num_expert_slots:
                raise ValueError(f"{ex.num_expert_slots} expert slots, routing says E+S = {self.cfg.num_expert_slots}")
            router, bias, table = self.routing_tensors()
            if tuple(router.shape) != (self.cfg.num_experts, ex.hidden_size):
                raise ValueError(
                    f"router weight {tuple(router.shape)}, expected {(self.cfg.num_experts, ex.hidden_size)}"
                )
            if bias is not None:
                check_selection_bias(bias, self.cfg.num_experts)
            if table is not None:
                check_hash_table(table, self.cfg.num_experts, self.cfg.top_k)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _apply(self, fn, recurse=True):
        return torch.nn.Module._apply(self, fn, recurse)  # the experts are parameters: they move with the module

    def extra_repr(self) -> str:
        c = self.cfg
        return f"E={c.num_experts}, S={c.num_fused_shared_experts}, top_k={c.top_k}, activation={self.activation}"
