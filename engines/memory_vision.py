"""A vision-language model's vision tower in the memory estimate (engines/memory.py): what its
forward keeps for backward, and its working set, per image patch.

The tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) embeds each 14x14 (x2 frames) patch, runs its
blocks over the patches at its own width ``e``, and its merger folds ``merge^2`` patches into
one image token of the decoder's width. A micro-batch's patches are the sum of ``t*h*w`` over
its images, ``merge^2`` per image token. Autograd keeps, per patch (:func:`saved_per_patch`):

- the patch embedding's input: the pixel row (``in_channels x temporal x patch^2``, 1176) cast
  to the compute dtype (a float32 tower keeps the batch's own float32 rows: no new bytes);
- per block: each norm's input and output (LayerNorm: 2e + mean and rstd; Qwen2.5-VL's
  RMSNorm: its input in float32, the normalised value and output, 1/rms), attention's qkv output (3e, its v a view of it), rotated q and k (2e),
  each image's attention output (e) and log-sum-exp (a float32 per head), the projection's
  input (e); the MLP's hidden tensors: fc1's output and the activation's output (2m;
  quick_gelu, x * sigmoid(1.702x), keeps its sigmoid too: 3m), Qwen2.5-VL's gated MLP 4m;
- the rotary cos and sin (float32, 2 x head_dim, shared by the blocks); Qwen3-VL's
  interpolated position embedding (4 int64 indices and 4 float32 weights);
- each merger (the projection, and Qwen3-VL's deepstack mergers): its norm (as above), fc1's
  and the activation's outputs (e each per patch).

With ``freeze_vision`` nothing before the mergers needs a gradient, so autograd records no
block at all (and the engine does not checkpoint frozen blocks); the mergers still train and
keep their norm's input (a LayerNorm saves it for its weight's gradient; the RMSNorm only its
normalised value) and their hidden tensors. With activation checkpointing a trained block keeps
its input. Counted against ``torch.autograd.graph.saved_tensors_hooks`` on the three tiny
presets (tests/cpu/engines/test_memory_vision.py): within 0.5% in float32, frozen or not,
checkpointed or not (Qwen2.5-VL's int64 window indices, a few bytes per image token, are left
out), 2% in bfloat16.

The tower runs before the decoder and its saved tensors live until the backward reaches it, so
a training step holds them beside the decoder's; inside its forward the tower also holds one
block's working set (:func:`working_set_per_patch`), the peak of a no-grad forward.
"""
from __future__ import annotations

from dataclasses import dataclass

FLOAT32 = 4
INT64 = 8
# The image processor's pixel rows are float32: a float32 tower reads the batch's own rows (no new
# bytes), any other compute dtype a copy that the patch embedding's convolution keeps.
PIXEL_BYTES = FLOAT32
# Tensors an MLP activation keeps beyond its input: quick_gelu, x * sigmoid(1.702 x), keeps the sigmoid.
ACTIVATION_EXTRA_SAVED = {"quick_gelu": 1}
RMS_NORM_TOWERS = {"qwen2_5_vl_vision"}      # RMSNorm and a gated (SwiGLU) MLP in the tower
INTERPOLATED_POSITIONS = {"qwen3_vl_vision"}  # a learned position table, bilinearly interpolated


@dataclass(frozen=True)
class TowerShape:
    """The sizes the tower's activations scale with (from a model's ``vision_config``)."""

    width: int          # e: the blocks' hidden size
    mlp: int            # m: the MLP's hidden size
    heads: int
    depth: int
    pixels: int         # a patch row: channels x temporal patch x patch^2
    merge: int          # spatial_merge_size: merge^2 patches per image token
    mergers: int        # the projection plus Qwen3-VL's deepstack mergers
    rms_norm: bool      # Qwen2.5-VL: RMSNorm and a gated MLP
    activation: str
    interpolated_positions: bool

    @classmethod
    def of(cls, vision_config) -> "TowerShape":
        width = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size  # Qwen2-VL: embed_dim
        mlp = getattr(vision_config, "intermediate_size", None) or int(width * vision_config.mlp_ratio)
        kind = vision_config.model_type
        return cls(width, mlp, vision_config.num_heads, vision_config.depth,
                   vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size ** 2,
                   vision_config.spatial_merge_size, 1 + len(getattr(vision_config, "deepstack_visual_indexes", [])),
                   kind in RMS_NORM_TOWERS, vision_config.hidden_act, kind in INTERPOLATED_POSITIONS)


def _norm(shape: TowerShape, compute_bytes: int, input_trains: bool, rows_per_patch: float = 1.0) -> float:
    """Bytes one norm keeps per patch, its output (the next linear's input) included;
    ``rows_per_patch``: 1 / merge^2 where it normalises a whole image token's row."""
    e = shape.width
    if not shape.rms_norm:
        return 2 * e * compute_bytes + 2 * FLOAT32 * rows_per_patch  # input, output; mean and rstd
    if not input_trains:
        return 2 * e * compute_bytes  # only the normalised value, for the weight's gradient
    # The input upcast to float32 (squared and scaled there), the normalised value, the output; 1/rms.
    return e * FLOAT32 + 2 * e * compute_bytes + FLOAT32 * rows_per_patch


def block_saved_per_patch(shape: TowerShape, compute_bytes: int) -> float:
    """Bytes one block keeps per patch: two norms, attention (qkv 3e, rotated q and k 2e, the
    output e and the projection's input e; a float32 log-sum-exp per head) and the MLP."""
    e, m = shape.width, shape.mlp
    mlp = 4 * m if shape.rms_norm else (2 + ACTIVATION_EXTRA_SAVED.get(shape.activation, 0)) * m
    return 2 * _norm(shape, compute_bytes, True) + (7 * e + mlp) * compute_bytes + shape.heads * FLOAT32


def saved_per_patch(shape: TowerShape, compute_bytes: int, frozen: bool, checkpointed: bool = False) -> float:
    """Bytes autograd keeps per image patch for the tower's backward (module docstring).
    ``checkpointed`` (engine.gradient_checkpointing, which transformers applies to the tower's
    blocks too): each trained block keeps only its input, and the rotary cos and sin (frozen
    blocks are not checkpointed: engines/parallel/fsdp.py)."""
    e = shape.width
    hidden = 2 * e * compute_bytes  # fc1's and the activation's outputs (merge^2 e wide per token)
    # The projection normalises each patch's e-wide row; Qwen3-VL's deepstack mergers normalise
    # an image token's merge^2 e-wide row after the shuffle (one mean and rstd per token).
    mergers = _norm(shape, compute_bytes, not frozen) + hidden + \
        (shape.mergers - 1) * (_norm(shape, compute_bytes, not frozen, 1 / shape.merge ** 2) + hidden)
    rotary = 2 * (e // shape.heads) * FLOAT32
    if frozen:  # no block keeps anything, a deepstack merger's input included
        return mergers
    # A deepstack merger's input is an inner block's output, which the next block keeps anyway.
    inner_inputs = (shape.mergers - 1) * e * compute_bytes
    per_block = e * compute_bytes if checkpointed else block_saved_per_patch(shape, compute_bytes)
    blocks = shape.depth * per_block + rotary - inner_inputs
    positions = 4 * (INT64 + FLOAT32) if shape.interpolated_positions else 0
    return _pixel_copy(shape, compute_bytes) + positions + blocks + mergers


def _pixel_copy(shape: TowerShape, compute_bytes: int) -> int:
    """Bytes per patch of the pixel row cast to the compute dtype (none in float32: the batch's own)."""
    return 0 if compute_bytes == PIXEL_BYTES else shape.pixels * compute_bytes


def working_set_per_patch(shape: TowerShape, compute_bytes: int) -> int:
    """Bytes live at once, per patch, inside one block's forward without autograd (as
    engines/memory.py's layer_working_set_per_token): the pixel row's cast copy, the residual
    stream and the normed input (2e) beside the larger of attention's qkv, rotated q and k and
    output (6e) and the MLP's hidden tensors (3m)."""
    e = shape.width
    return _pixel_copy(shape, compute_bytes) + (2 * e + max(6 * e, 3 * shape.mlp)) * compute_bytes


class TowerMemory:
    """The tower's activation bytes for a micro-batch of ``patches`` image patches."""

    def __init__(self, vision_config, compute_bytes: int, frozen: bool) -> None:
        self.shape, self.compute_bytes, self.frozen = TowerShape.of(vision_config), compute_bytes, frozen

    def saved(self, patches: int, checkpointed: bool = False) -> int:
        """Kept for backward from the tower's forward until the backward is through it."""
        return int(patches * saved_per_patch(self.shape, self.compute_bytes, self.frozen, checkpointed))

    def transient(self, patches: int, checkpointed: bool = False) -> int:
        """The most the tower adds while it runs: one block's forward working set, or (a
        trained, checkpointed tower) one block recomputed in the backward."""
        work = patches * working_set_per_patch(self.shape, self.compute_bytes)
        if checkpointed and not self.frozen:
            return max(work, int(patches * block_saved_per_patch(self.shape, self.compute_bytes)))
        return work


class NoTower:
    """A text model's: no patches, no bytes."""

    def saved(self, patches: int, checkpointed: bool = False) -> int:
        return 0

    def transient(self, patches: int, checkpointed: bool = False) -> int:
        return 0


def tower_memory(model, compute_bytes: int, frozen: bool) -> TowerMemory | NoTower:
    """The :class:`TowerMemory` of ``model`` (built on the meta device); :class:`NoTower` for a text model."""
    vision = getattr(model.config, "vision_config", None)
    return NoTower() if vision is None else TowerMemory(vision, compute_bytes, frozen)
