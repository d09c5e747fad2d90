"""KV storage of the hf engine: a slab with one row per live sequence, and a prefix cache.

Why not transformers' DynamicCache: it appends with `torch.cat`, so every decode step copies the
whole cache of every layer, and a sequence joining a running batch must be padded to the batch's
length (another copy of everything). Measured side by side in benchmarks/kv_cache_decode.py.

The slab is, per layer, one tensor [2 (keys, values), rows, kv_heads, columns, head_dim]. A forward
writes its new keys/values in place at (row, column) pairs it chooses and attends to a prefix of
columns under a 4D mask the scheduler builds, so rows have lengths of their own. A sequence joins
by filling its own row, leaves by having the last row moved into its place (one row copied), and
a shared prefix is one copy of its columns from another row or from the prefix cache.

Columns are storage, not positions: rotary positions come from `position_ids`, which is what lets
the choices of one request sit side by side in a row (tree attention, see the scheduler).

Unwritten columns are zeros and stale columns hold finite values from earlier sequences: masked
columns get zero attention weight, and 0 x finite = 0 (0 x NaN would not be), which is why the
slab starts zeroed and why padding queries attend column 0 instead of nothing.

Columns grow by half, like rows. Growing them to the next multiple of 64 instead was tried
(2026-12-06): whole replays showed no effect (0.98 [0.93, 1.04]), and with kept storage every growth
past the largest slab so far zeroes a new buffer, up to 12x the final slab's bytes for a first
batch decoding from 300 to 1,500 columns (2.6x growing by half). So it was not kept
(docs/design.md, section 8).

Storage. Each layer's keys and values live in a flat buffer of their own, and a layer's slab
[2, rows, kv_heads, columns, head_dim] is a view of its buffer's start. A slab grows by half when
rows join or columns run out; where the buffer holds the larger shape, the layer is re-laid in
place (its live part copied out to a scratch buffer of one layer, then into the larger view), and
only where it does not is a larger buffer made, the layer copied into it and the old one freed,
one layer at a time. So a growth holds the slab plus one layer, never two slabs: with one tensor
for all layers, the old slab and the one it was copied into held up to twice the bound, about 0.9
GiB of `whale demo`'s peak (docs/performance.md). The re-laid columns hold stale finite values of
the smaller layout, which the invariant above covers. Each layer's view has the shape and strides
of the one-tensor slab's layer, so no forward sees another shape and no sampled id changes.

On CPU a cleared slab keeps its buffers: new memory costs page faults on its first touch (measured
on the math workload, 64 episodes, a slab growing 10 times to 82 rows x 320 columns, 577 MiB: the
growths into new tensors took 1.8-4.3 s of a 10-12 s batch, against 0.02 s for the copies
themselves), so every later batch grows inside the buffers the largest slab so far left, and only
a slab larger than any before touches new memory. Elsewhere (CUDA's caching allocator reuses blocks
without faults) a clear frees them. `fresh_bytes` and `fresh_seconds` count the new storage and the
time its zeroing took (2-3 ms per MiB on the 2-core AMX Xeon while the runner worked beside the
engine), so a benchmark can tell this one-off cost of an engine's first slab of a size from its
steady state.

Bound (`max_bytes`, the hf engine's `model.kv_cache_mib`): a growth never makes the slab larger
than `max_bytes` unless the rows and columns asked for need more (the scheduler admits rows so
that they do not, engine/scheduler.py), and a clear keeps the buffers only if they fit in it. So the
slab holds at most `max_bytes` between batches, and one layer more (the scratch) while it grows.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class KVSlab:
    """Keys and values of the sequences in flight, one view per layer; allocated on the first write,
    grown on demand (module docstring, "Storage")."""

    def __init__(self, n_layers: int, device: torch.device, keep_storage: bool | None = None,
                 max_bytes: int | None = None):
        self.n_layers = n_layers
        self.max_bytes = max_bytes  # None: unbounded (module docstring, "Bound")
        self.device = device
        self.keep_storage = device.type == "cpu" if keep_storage is None else keep_storage
        self.buffers: list[torch.Tensor] = []  # one flat buffer per layer, the layers' views cut from their starts
        self.scratch: torch.Tensor | None = None  # one layer's room: its live part while its buffer is re-laid
        self.layers: list[torch.Tensor] | None = None  # [2, rows, heads, cols, dim] per layer; None: not allocated
        self.rows = 0  # capacity, allocated or wanted
        self.cols = 0
        self.kind: tuple[int, int, torch.dtype] | None = None  # (kv heads, head dim, dtype) once seen
        self.fresh_bytes = 0  # new storage zeroed so far, and the seconds it took (module docstring)
        self.fresh_seconds = 0.0

    @property
    def column_bytes(self) -> int:
        """Bytes of one row's column over all layers (keys and values); 0 before the first keys."""
        if self.kind is None:
            return 0
        heads, dim, dtype = self.kind
        return self.n_layers * 2 * heads * dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the live slab (rows x columns of every layer)."""
        return 0 if self.layers is None else self.rows * self.cols * self.column_bytes

    @property
    def storage_bytes(self) -> int:
        """Bytes of storage held: the layers' buffers and the scratch."""
        held = self.buffers + ([self.scratch] if self.scratch is not None else [])
        return sum(b.numel() * b.element_size() for b in held)

    def clear(self) -> None:
        """Empty the slab (the scheduler does when it goes idle, e.g. before training); the next
        batch starts from an empty slab again. Frees the storage unless `keep_storage`, and keeps
        the buffers only while they fit the bound."""
        self.layers, self.rows, self.cols = None, 0, 0
        held = sum(b.numel() * b.element_size() for b in self.buffers)
        if not self.keep_storage or (self.max_bytes is not None and held > self.max_bytes):
            self.buffers, self.scratch = [], None

    def release(self) -> None:
        """Empty the slab and free its storage."""
        self.layers, self.rows, self.cols, self.buffers, self.scratch = None, 0, 0, [], None

    def reserve(self, rows: int, cols: int) -> None:
        """Make room for `rows` rows of `cols` columns, keeping what is stored."""
        if rows <= self.rows and cols <= self.cols and (self.layers is not None or self.kind is None):
            return
        # grow by half at least, so rows joining one by one (or a sequence growing one column per
        # step) copy the slab a logarithmic number of times, not on every join
        new_rows = self.rows if rows <= self.rows else max(rows, self.rows + self.rows // 2, 4)
        new_cols = self.cols if cols <= self.cols else max(cols, self.cols + self.cols // 2)
        new_cols = -(-new_cols // 64) * 64
        if self.max_bytes is not None and self.kind is not None:
            # growing by half past the bound: grow only to what is asked (columns stay whole 64s)
            if new_rows * new_cols * self.column_bytes > self.max_bytes:
                # only the rows asked for are in use (rows are 0..rows-1): spare rows kept from an
                # earlier, narrower batch go, or 48 rows of short prompts then 19 long ones held
                # 48 rows x 448 columns, 2.5x the bound (float32 demo evaluation, 2026-12-08)
                new_rows = rows
            if new_rows * new_cols * self.column_bytes > self.max_bytes:
                new_cols = max(-(-cols // 64) * 64, self.cols)
        old = self.layers
        self.rows, self.cols = new_rows, new_cols
        if self.kind is not None:
            self._allocate(old)

    def _allocate(self, old: list[torch.Tensor] | None = None) -> None:
        """Lay every layer out at the current rows x columns, copying the `old` layers' contents in:
        in place where the buffers have room, else into larger buffers, one layer at a time."""
        heads, dim, dtype = self.kind
        self.rows, self.cols = max(self.rows, 1), max(self.cols, 64)
        shape = (2, self.rows, heads, self.cols, dim)
        numel = math.prod(shape)
        grows = not self.buffers or self.buffers[0].numel() < numel  # every layer's buffer has the same room
        if grows:
            self.scratch = None  # made again at the new room, after the layers' buffers
        layers = []
        for index in range(self.n_layers):
            live = None
            if old is not None:  # dropped from the list, so each old buffer is freed once copied
                live, old[index] = old[index][:, : self.rows], None  # rows past the new count are not in use
            if grows:
                self.buffers[index:index + 1] = [self._zeros(numel, dtype)]
            elif live is not None:  # re-laid in place: the live part goes out to the scratch first
                live = self.scratch[: live.numel()].view(live.shape).copy_(live)
            layer = self.buffers[index][:numel].view(shape)
            if live is not None:
                layer[:, : live.shape[1], :, : live.shape[3]] = live
            layers.append(layer)
        live = None  # the last old layer, freed before the scratch is made
        if grows:
            self.scratch = self._zeros(numel, dtype)
        self.layers = layers

    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """New zeroed storage, counted in `fresh_bytes` and `fresh_seconds`."""
        t0 = time.perf_counter()
        out = torch.zeros(numel, dtype=dtype, device=self.device)
        self.fresh_seconds += time.perf_counter() - t0
        self.fresh_bytes += out.numel() * out.element_size()
        return out

    def layer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """[2, rows, heads, cols, dim] of layer `index`; the first keys ever seen fix the slab's shape."""
        kind = (like.shape[1], like.shape[3], like.dtype)
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise ValueError("the hf engine needs the same number of KV heads, head size and dtype in every layer")
        if self.layers is None:
            self._allocate()
        return self.layers[index]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        if length > 0 and src != dst:
            for kv in self.layers:
                kv[:, dst, :, :length] = kv[:, src, :, :length]

    def load_row(self, dst: int, kv: torch.Tensor, length: int) -> None:
        """Write the first `length` columns of a prefix-cache entry [layers, 2, heads, cols, dim]."""
        if length > 0:
            for layer, entry in zip(self.layers, kv):
                layer[:, dst, :, :length] = entry[:, :, :length]

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """Row `row`'s first `length` columns of every layer: [layers, 2, heads, length, dim]."""
        return torch.stack([kv[:, row, :, :length] for kv in self.layers])

    def view(self, first_row: int, n_rows: int, write_rows: torch.Tensor, write_cols: torch.Tensor,
             read_cols: int) -> "SlabView":
        return SlabView(self, first_row, n_rows, write_rows, write_cols, read_cols)


class SlabView(Cache):
    """What one forward sees as its KV cache: rows [first_row, first_row + n_rows) of the slab.

    `update` (called by every attention layer) writes the new keys/values of query (i, t) at slab
    row write_rows[i, t], column write_cols[i, t], and returns the first `read_cols` columns of the
    forward's rows (a view: no copy of the cache).
    """

    def __init__(self, slab: KVSlab, first_row: int, n_rows: int, write_rows: torch.Tensor,
                 write_cols: torch.Tensor, read_cols: int):
        super().__init__(layers=[])
        self.slab = slab
        self.first_row, self.n_rows = first_row, n_rows
        self.write_rows, self.write_cols = write_rows, write_cols
        self.read_cols = read_cols

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        kv = self.slab.layer(layer_idx, key_states)
        keys, values = kv[0], kv[1]
        # advanced indices around a slice: the indexed shape is [batch, query, heads, dim]
        keys[self.write_rows, :, self.write_cols] = key_states.transpose(1, 2)
        values[self.write_rows, :, self.write_cols] = value_states.transpose(1, 2)
        rows = slice(self.first_row, self.first_row + self.n_rows)
        return keys[rows, :, : self.read_cols], values[rows, :, : self.read_cols]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.read_cols

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass
class _Entry:
    key: int
    ids: np.ndarray
    kv: torch.Tensor  # [layers, 2, heads, len(ids), dim]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """KV of token sequences seen before, least recently used evicted first, bounded in bytes.

    An entry's KV at column t depends only on ids[: t + 1] and on the weights, so any request whose
    prompt starts with an entry's first t ids can copy those t columns instead of computing them.
    The owner must `clear()` it whenever the weights change.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.bytes = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def longest(self, ids: np.ndarray) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `ids`, and that length."""
        best, best_len = None, 0
        for entry in self.entries.values():
            n = common_prefix(ids, entry.ids)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def used(self, entry: _Entry) -> None:
        """Mark `entry` as just used (copied from), so it is evicted last."""
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)

    def wants(self, ids: np.ndarray, nbytes: int) -> bool:
        """Is an entry of `ids` (costing `nbytes`) worth storing: it fits, and no entry already covers it?"""
        if nbytes > self.max_bytes:
            return False
        return not any(len(e.ids) >= len(ids) and common_prefix(ids, e.ids) == len(ids)
                       for e in self.entries.values())

    def add(self, ids: np.ndarray, kv: torch.Tensor) -> None:
        """Store `kv` for `ids`; drop entries it covers, then the least recently used until it fits."""
        for key in [k for k, e in self.entries.items() if len(e.ids) <= len(ids)
                    and common_prefix(ids, e.ids) == len(e.ids)]:
            self.bytes -= self.entries.pop(key).nbytes
        self._next += 1
        entry = _Entry(self._next, ids, kv)
        while self.entries and self.bytes + entry.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        self.entries[entry.key] = entry
        self.bytes += entry.nbytes
