"""The device-backend contract: everything the rest of polyfsdp may ask of a device."""
from __future__ import annotations

import os

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, MutableMapping

import torch


# Keywords of varlen (packed) attention that polyfsdp adds to transformers' own. The engine puts
# them in a packed row's model inputs (beside transformers' ``cu_seq_lens_q``/``_k``), and every
# attention function a backend picks (``Backend.attn_implementation``: ``polyfsdp_varlen_sdpa`` on
# CPUs and CUDA, the fusion-attention patch on NPUs) reads them, so they live with that contract.
# HOST_CU_SEQ_LENS: a host copy (list of ints) of ``cu_seq_lens_q``; a function that needs the
# boundaries on the host reads it instead of the device tensor, which would stall the device once
# per layer.
HOST_CU_SEQ_LENS = "polyfsdp_host_cu_seq_lens"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot be used here; the message says why."""


class UnknownBackendError(BackendUnavailableError, ValueError):
    """A backend name (``backend=`` or ``POLYFSDP_BACKEND``) that is not one of ours: a
    ValueError for callers, and one line from ``polyfsdp-train`` like any unusable backend."""


@dataclass(frozen=True)
class ModelFacts:
    """What a backend may ask of a model before its fused ops replace the plain ones: the
    shapes its config fixes and the dtype it computes in (the FSDP ``param_dtype``)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    compute_dtype: torch.dtype


class Backend(ABC):
    """One device family (cpu, cuda, npu). Subclasses are the only code naming a device.

    Calls every device runtime has (bind, synchronize, seed, RNG state) are written once
    here against torch's per-device module (``torch.cuda``, ``torch.npu``, ``torch.cpu``);
    subclasses hold only what differs: availability, attention choice, fused ops.
    """

    name: str
    device_type: str
    dist_backend: str
    # Attention implementation name passed to transformers; the engine registers
    # polyfsdp's own implementations before building a model.
    default_attn_implementation: str = "sdpa"
    # Whether the device module keeps generators of its own (torch.cpu has none: the CPU
    # generator is torch's default one, which torch.manual_seed and checkpoints cover).
    has_device_generators: bool = True
    # Whether the device's memory IS host memory (the CPU): offloading to the host then
    # moves nothing (engines/parallel/offload.py turns it into a notice).
    memory_is_host: bool = False
    # The caching allocator's settings variable (PYTORCH_CUDA_ALLOC_CONF, ...), None without one.
    alloc_conf_variable: str | None = None
    # torch's process-group timeout when the collective library sets none of its own.
    process_group_timeout_s: float = 600.0

    # The vLLM build for this device (trainer/rollout/vllm_adapter.py names it in the install hint).
    vllm_package: str = "vllm"
    # Whether vLLM may split a prompt's prefill over steps (chunked prefill) while requests carry
    # their own seeds (polyfsdp's always do): it then rewinds a request's generator, which needs
    # a generator with an offset.
    vllm_chunked_prefill: bool = True
    # Rollout servers (trainer/rollout/servers/): the environment variable that gives a server its
    # devices (rollout.server.devices), and the weight-transfer backend that pushes the trainer's
    # weights to them: polyfsdp_cpu moves bytes through host memory over gloo, which works with every
    # device (vLLM copies what arrives onto its own), so it is the default wherever a device library
    # path has not been run here.
    server_devices_variable: str | None = None
    server_weight_transfer: str = "polyfsdp_cpu"

    def weight_transfer_sender(self, master_address: str, master_port: int, world_size: int):
        """The trainer's end of ``server_weight_transfer`` when that is this device's own (rank 0 of
        its transfer group: ``worker_init_info(rank_offset)``, ``connect()``, ``send(tensors,
        requests)``, ``close()``); None where it is polyfsdp_cpu, whose sender is polyfsdp's."""
        return None

    def server_cores(self, devices: str) -> set[int] | None:
        """The host cores a started rollout server's processes run on, from its
        ``rollout.server.devices`` entry; None: where its parent runs (devices are not cores)."""
        return None

    def rollout_sleep_level(self, lora: bool) -> int | None:
        """How deep a colocated vLLM sleeps while the trainer steps: 2 frees its weights and KV
        cache, 1 offloads the weights to the host and frees the KV cache (what LoRA runs need,
        whose base weights must survive), None: sleeping frees nothing on this device."""
        return 1 if lora else 2

    @abstractmethod
    def availability(self) -> str | None:
        """Return None when usable, else a plain-words reason why not."""

    def _device_module(self) -> ModuleType:
        """torch's module for this device type (``torch.cuda``, ``torch.npu``, ``torch.cpu``)."""
        # The lookup torch.get_device_module does, minus two things it adds: it parses the
        # name as a torch.device (``npu`` is no device type until torch_npu registers it) and
        # caches the module for good (tests swap torch.npu stand-ins in and out).
        return getattr(torch, self.device_type)

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device a process with this local rank should use."""
        return torch.device(self.device_type, local_rank)

    def device_count(self) -> int:
        """How many devices of this type the host has (how many local ranks can each own one)."""
        return int(self._device_module().device_count())

    def set_device(self, local_rank: int = 0) -> None:
        """Bind the current process to its device (a no-op on CPU)."""
        self._device_module().set_device(local_rank)

    def synchronize(self) -> None:
        """Wait for all queued device work."""
        self._device_module().synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every device generator of this backend."""
        torch.manual_seed(seed)
        if self.has_device_generators:
            self._device_module().manual_seed_all(seed)

    def get_rng_state(self) -> dict:
        """RNG state of the device generators, keyed by device type (CPU state is saved separately)."""
        if not self.has_device_generators:
            return {}
        return {self.device_type: self._device_module().get_rng_state_all()}

    def set_rng_state(self, state: dict) -> None:
        """Restore what :meth:`get_rng_state` returned."""
        if self.device_type in state:
            self._device_module().set_rng_state_all(state[self.device_type])

    def free_memory_bytes(self) -> int | None:
        """Free memory on this process's device, or None when the runtime cannot say (the
        CPU: host memory, not worth guarding here)."""
        info = getattr(self._device_module(), "mem_get_info", None)
        return None if info is None else int(info()[0])

    def memory_capacity_bytes(self) -> int | None:
        """All the memory one process's tensors can live in: the device's total, or the host's
        physical memory where device memory is host memory (the CPU); None when unknown. A job
        whose smallest working set exceeds it cannot run (trainer/config/machine_fit.py: check_fits)."""
        if self.memory_is_host:
            try:
                return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):  # not a POSIX host
                return None
        info = getattr(self._device_module(), "mem_get_info", None)
        return None if info is None else int(info()[1])

    def attn_implementation(self, compute_dtype: torch.dtype) -> str:
        """The attention implementation for a model computing in ``compute_dtype`` (the FSDP
        ``param_dtype``): ``default_attn_implementation`` unless a backend's kernels depend on it."""
        return self.default_attn_implementation

    def reset_peak_memory(self) -> None:
        """Start a new allocated-memory high-water mark (no-op where the runtime has none)."""
        reset = getattr(self._device_module(), "reset_peak_memory_stats", None)
        if reset is not None:
            reset()

    def allocated_memory_bytes(self) -> tuple[int, int] | None:
        """``(allocated now, high-water mark since reset_peak_memory)`` on this process's
        device, or None when the runtime keeps no such count (the CPU: measure host RSS)."""
        module = self._device_module()
        now, peak = getattr(module, "memory_allocated", None), getattr(module, "max_memory_allocated", None)
        return None if now is None or peak is None else (int(now()), int(peak()))

    # True: torch.compile may lack a toolchain here; the fused head tries it and falls back to
    # its eager kernels with one logged line. False: a compile error is a bug and propagates.
    compile_may_fail: bool = False
    # Whether ``fused_kernel_impl=auto`` compiles here: worth it where compiled kernels beat
    # eager by far (GPUs); not where the first call's compilation outweighs a job's head time.
    compile_by_default: bool = True

    def compile_unsupported(self) -> str | None:
        """None when ``torch.compile`` (through :meth:`compile_backend`) may build kernels on
        this device, else why not."""
        return f"torch.compile is not declared for the {self.name} backend"

    def compile_backend(self):
        """The ``backend=`` argument for ``torch.compile`` here (a name or a callable)."""
        return "inductor"

    def fused_ops(self) -> dict[str, Callable]:
        """Fused kernels this backend offers, by op name (``rms_norm``, ``rotary_mul``,
        ``swiglu``, ``fusion_attention``). Patches are written against this table."""
        return {}

    def prepare_process_group(self, environ: MutableMapping[str, str]) -> tuple[float, str | None]:
        """Before the process group starts: set what the collective library reads from the
        environment, and return (the process-group timeout in seconds, a line saying what was set
        or None)."""
        return self.process_group_timeout_s, None

    def vllm_sleep_mode_conflict(self, rollout_engine_is_vllm: bool, environ: Mapping[str, str]) -> str | None:
        """One line when the allocator settings conflict with vLLM's sleep mode, else None.
        vLLM's sleep mode refuses ``expandable_segments:True``: its memory pool needs fixed
        addresses (vllm-project/vllm#14189, pytorch/pytorch#147851; on Ascend the same through
        PYTORCH_NPU_ALLOC_CONF, modelscope/ms-swift#6636). The vLLM rollout engine calls it
        when it will sleep (trainer/rollout/vllm.py)."""
        if not rollout_engine_is_vllm or self.alloc_conf_variable is None:
            return None
        conf = environ.get(self.alloc_conf_variable, "")
        for item in conf.split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return (f"{self.alloc_conf_variable}={conf!r} turns on expandable_segments, which vLLM's sleep "
                        f"mode cannot run with: remove it (or set expandable_segments:False) for the vLLM rollout")
        return None

    def fused_op_unsupported(self, op: str, facts: ModelFacts) -> str | None:
        """Why the fused op ``op`` must not run for a model with these facts (a documented
        limit of the device's kernel), or None. Checked before a patch applies."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"
