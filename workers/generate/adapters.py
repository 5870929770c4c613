"""The adapters one base serves: PEFT adapters read from storage on first use into slots of the per-row LoRA
modules (workers.lora.row_slots, workers.experts.serving_slots), least recently used evicted beyond `max_adapters`,
never one that a running request still uses."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from moetune.api import storage
from moetune.workers.experts.lora_layout import a_from_peft, b_from_peft, lora_scaling
from moetune.workers.experts.serving_slots import RowLoraExperts
from moetune.workers.generate.requests import AdapterLoadError
from moetune.workers.lora.row_slots import RowLoraLinear, RowSelection

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FACTOR_SUFFIX = {".lora_A.weight": "a", ".lora_B.weight": "b"}
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "layers_to_transform": "layers_to_transform"}


@dataclass
class ParsedAdapter:
    """Factors per module path: linears {"a", "b"}, experts {"gate_up_a", ..., "down_b"}; one scaling."""

    linears: dict[str, dict[str, torch.Tensor]]
    experts: dict[str, dict[str, torch.Tensor]]
    scaling: float

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for group in (self.linears, self.experts) for f in group.values() for t in f.values())


def read_adapter(uri: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of the adapter at `uri`; AdapterLoadError saying what is wrong."""
    from safetensors.torch import load

    try:
        config = json.loads(storage.read_text(storage.join(uri, CONFIG_FILE)))
        tensors = load(storage.read_bytes(storage.join(uri, WEIGHTS_FILE)))
    except FileNotFoundError as e:
        raise AdapterLoadError(f"adapter {uri}: {e.filename or e} not found (no PEFT adapter there)") from None
    except json.JSONDecodeError as e:
        raise AdapterLoadError(f"adapter {uri}: {CONFIG_FILE} is not JSON ({e})") from None
    except Exception as e:  # storage errors (credentials, endpoint), a corrupt safetensors file
        raise AdapterLoadError(f"adapter {uri}: cannot be read ({type(e).__name__}: {e})") from None
    return config, tensors


def _scaling(uri: str, config: dict) -> float:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"adapter {uri}: peft_type {config.get('peft_type')!r}, only LORA is served")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterLoadError(f"adapter {uri}: {what} is not served (adapter_config.json: {key})")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not r or alpha is None:
        raise AdapterLoadError(f"adapter {uri}: adapter_config.json has no r / lora_alpha")
    return lora_scaling(alpha, r, bool(config.get("use_rslora")))


def _expert_param(uri: str, path: str, depth: int, target_parameters: list[str]) -> str:
    """Which fused tensor a key of the experts module adapts: PEFT nests one wrapper per targeted tensor, the
    first listed innermost (`base_layer.` once per wrapper around it)."""
    names = [t.rsplit(".", 1)[1] for t in target_parameters
             if path == t.rsplit(".", 1)[0] or path.endswith("." + t.rsplit(".", 1)[0])]
    if depth >= len(names):
        raise AdapterLoadError(f"adapter {uri}: LoRA on {path} that target_parameters {target_parameters} "
                               "does not list")
    return names[len(names) - 1 - depth]


def parse_adapter(uri: str, config: dict, tensors: dict[str, torch.Tensor], linears: dict[str, nn.Module],
                  experts: dict[str, RowLoraExperts]) -> ParsedAdapter:
    """The adapter's factors by module of this base, every shape checked (nothing is installed yet).
    `linears`: path -> the module a linear LoRA would wrap; `experts`: path -> the per-row experts."""
    scaling = _scaling(uri, config)
    found_linears: dict[str, dict] = {}
    found_experts: dict[str, dict] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _FACTOR_SUFFIX if key.endswith(s)), None)
        if suffix is None or not key.startswith(_PREFIX):
            raise AdapterLoadError(f"adapter {uri}: unexpected tensor {key!r} (not a LoRA factor)")
        path, depth = key[len(_PREFIX):-len(suffix)], 0
        while path.endswith(".base_layer"):
            path, depth = path[:-len(".base_layer")], depth + 1
        factor = _FACTOR_SUFFIX[suffix]
        if path in experts:
            param = _expert_param(uri, path, depth, config.get("target_parameters") or [])
            which = "down" if param == "down_proj" else "gate_up"
            found_experts.setdefault(path, {})[f"{which}_{factor}"] = tensor
        elif path in linears and depth == 0:
            found_linears.setdefault(path, {})[factor] = tensor
        else:
            raise AdapterLoadError(f"adapter {uri}: {key!r} names no linear or experts module of this base model "
                                   "(an adapter of another model?)")
    for path, factors in found_linears.items():
        _check_linear(uri, path, factors, linears[path])
    parsed_experts = {path: _expert_factors(uri, path, factors, experts[path])
                      for path, factors in found_experts.items()}
    return ParsedAdapter(found_linears, parsed_experts, scaling)


def linear_dims(module: nn.Linear) -> tuple[int, int]:
    """(in, out) of a linear, dense or quantized (kernels.moe.linear's QuantizedLinear is an nn.Linear)."""
    return module.in_features, module.out_features


def _check_linear(uri: str, path: str, factors: dict, module: nn.Module) -> None:
    if factors.keys() != {"a", "b"}:
        raise AdapterLoadError(f"adapter {uri}: {path} has lora_{'A' if 'a' not in factors else 'B'} missing")
    a, b = factors["a"], factors["b"]
    in_features, out_features = linear_dims(module)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1]:
        raise AdapterLoadError(f"adapter {uri}: {path} LoRA shapes A {list(a.shape)}, B {list(b.shape)} do not fit "
                               f"its linear ({in_features} -> {out_features}): an adapter of another model?")


def _expert_factors(uri: str, path: str, factors: dict, experts: RowLoraExperts) -> dict:
    if experts.transposed:
        raise AdapterLoadError(f"adapter {uri}: expert LoRA on this family's transposed expert tensors is not "
                               "served yet")
    if len(factors) != 4:
        raise AdapterLoadError(f"adapter {uri}: {path} needs LoRA on both expert tensors, has {sorted(factors)}")
    e = experts.num_experts
    try:
        out = {n: (a_from_peft if n.endswith("_a") else b_from_peft)(factors[n], e) for n in RowLoraExperts.FACTORS}
    except RuntimeError as err:
        raise AdapterLoadError(f"adapter {uri}: {path} expert LoRA does not fit {e} experts ({err})") from None
    w_in, w_down = experts.experts.base_weights()
    want = {"gate_up_a": w_in.shape[2], "gate_up_b": w_in.shape[1], "down_a": w_down.shape[2],
            "down_b": w_down.shape[1]}
    for name, size in want.items():
        got = out[name].shape[2 if name.endswith("_a") else 1]
        if got != size:
            raise AdapterLoadError(f"adapter {uri}: {path} {name} is {list(out[name].shape)}, the experts need "
                                   f"width {size}: an adapter of another model?")
    return out


class AdapterStore:
    """Slots 1..max_adapters of the per-row LoRA modules (slot 0 is the base), filled least recently used first."""

    def __init__(self, model: nn.Module, selection: RowSelection, experts: dict[str, RowLoraExperts],
                 max_adapters: int, dtype, device):
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be at least 1, got {max_adapters}")
        self.model, self.selection, self.experts = model, selection, experts
        self.max_adapters, self.dtype, self.device = max_adapters, dtype, device
        self.linears: dict[str, RowLoraLinear] = {}  # the linears some adapter adapted (wrapped on first use)
        self.slots: OrderedDict[str, int] = OrderedDict()  # uri -> slot, least recently used first
        self.in_use: dict[int, int] = {}  # slot -> running requests
        self.bytes: dict[int, int] = {}
        self.loads = self.evictions = self.failures = 0

    def _linear_candidates(self) -> dict[str, nn.Module]:
        candidates = {name: m for name, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        candidates.update({path: wrapper.base_layer for path, wrapper in self.linears.items()})
        return candidates

    def acquire(self, uri: str) -> int | None:
        """The slot of adapter `uri` (loaded now if needed), held until `release`; None when every slot is held
        by running requests (ask again after some finish). AdapterLoadError when it cannot be loaded."""
        if uri in self.slots:
            self.slots.move_to_end(uri)
            slot = self.slots[uri]
        else:
            if len(self.slots) >= self.max_adapters and all(self.in_use.get(s) for s in self.slots.values()):
                return None
            try:
                parsed = parse_adapter(uri, *read_adapter(uri), self._linear_candidates(), self.experts)
            except AdapterLoadError:
                self.failures += 1
                raise
            slot = self._free_slot()
            self._install(slot, parsed)  # every module's slot is overwritten: zeros where this adapter has none
            self.slots[uri], self.bytes[slot] = slot, parsed.nbytes
            self.loads += 1
        self.in_use[slot] = self.in_use.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        self.in_use[slot] -= 1

    def _free_slot(self) -> int:
        """A slot no adapter holds, else the least recently used one no running request holds (evicted)."""
        taken = set(self.slots.values())
        free = [s for s in range(1, self.max_adapters + 1) if s not in taken]
        if free:
            return free[0]
        victim = next(uri for uri, slot in self.slots.items() if not self.in_use.get(slot))
        slot = self.slots.pop(victim)
        self.bytes.pop(slot, None)
        self.evictions += 1
        return slot

    def _install(self, slot: int, parsed: ParsedAdapter) -> None:
        for path in parsed.linears.keys() - self.linears.keys():
            self._wrap(path)
        for path, module in self.linears.items():
            module.factors.put(slot, parsed.linears.get(path), parsed.scaling)
        for path, module in self.experts.items():
            module.factors.put(slot, parsed.experts.get(path), parsed.scaling)

    def _wrap(self, path: str) -> None:
        parent_name, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        base = getattr(parent, child)
        in_features, out_features = linear_dims(base)
        wrapper = RowLoraLinear(base, self.selection, self.max_adapters + 1, in_features, out_features, self.dtype,
                                self.device)
        setattr(parent, child, wrapper)
        self.linears[path] = wrapper

    def stats(self) -> dict:
        return {"adapters_loaded": len(self.slots), "adapter_loads": self.loads, "adapter_evictions": self.evictions,
                "adapter_load_failures": self.failures, "adapter_bytes": sum(self.bytes.values()),
                # what the slots hold allocated: one row per loaded adapter that adapts a module, at the largest rank
                "adapter_slot_bytes": sum(m.factors.nbytes() for m in (*self.linears.values(),
                                                                        *self.experts.values())),
                "adapters": list(self.slots)}
