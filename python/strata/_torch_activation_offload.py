"""Activation checkpoints kept in pinned host memory while the forward runs
on, fetched back ahead of their recompute.

Note [Activation checkpoints in host memory]
With activation checkpointing, what a checkpointed block keeps between its
forward and its backward is its inputs (the rest is recomputed). On a GPU
those inputs, one per block, stay on the device for the whole forward; with
`activation_checkpointing.cpu_checkpointing` they live in pinned host
memory instead:
  forward   each input is copied to a pinned host buffer on a copy stream of
            its own (which first waits for torch's stream, where the input
            was made); the device tensor is then torch's to free, and the
            copy stream is recorded on it so the allocator does not reuse
            its memory before the copy has read it;
  backward  a checkpoint's inputs are fetched back on the copy stream (into
            memory allocated there: a block torch's stream freed may still be
            read by its queued kernels), and as they are handed to its
            recompute the previous checkpoint's (the next to run backward)
            are fetched too, so that copy overlaps this block's recompute and
            backward; torch's stream waits on the fetch's event, never the
            host, and is recorded on the fetched tensor.
Every copy runs on the one copy stream, so a host buffer is reused only in
that stream's order: a buffer goes back to the pool when its checkpoint is
gone (the graph freed after backward, or dropped without one), and a later
copy into it runs after every earlier copy out of it. Buffers come in size
classes (at most 1/8 above the request), and the pool keeps free no more
bytes than were in use at once, so after the first step of a shape no pinned
memory is allocated (`stats()` counts it), and lengths that vary from step
to step neither miss every time nor pile up. An input written in place after
it was saved is refused at its unpack, as torch refuses it (torch skips its
own check when saved tensors have hooks). The fetched copies are allocated
on the copy stream, so their blocks stay in that stream's share of torch's
caching allocator. One driving thread per process, as strata.torch has:
the checkpoint numbering is not per thread.

The copies are a small interface (`_CudaCopies`); a stand-in on the cpu
device (`_RecordedCopies`) plays the same order with clones and logs each
copy and wait, for tests of this order without a GPU. On the cpu device
itself the inputs are already in host memory and are kept as they are.
Only inputs on the copies' device move; a parameter passed as an input
stays where it is (it is the engine's, not an activation)."""
import collections
import contextlib
import threading
import weakref

import torch

__all__ = ["ActivationOffload", "HostBufferPool"]


class HostBufferPool:
    """Pinned host buffers (flat) reused across steps. A request is rounded up to a size class (at most 1/8
    above it), so inputs whose lengths vary from step to step (dynamic padding) share buffers; the buffers
    kept free never hold more bytes than were in use at once at the peak (the least recently given back go
    first), so the pool stays at the working set's size."""

    def __init__(self, pin):
        self._pin = pin
        self._free = {}                     # (dtype, class length) -> buffers, the most recent last
        self._given_back = collections.deque()  # (key, buffer) in the order they came back; stale once taken
        self._free_ids = set()
        self._lock = threading.Lock()  # a finalizer may give a buffer back from another thread
        self._in_use_bytes = 0
        self._peak_in_use_bytes = 0
        self._free_bytes = 0
        self.buffers_made = 0
        self.bytes_made = 0

    @staticmethod
    def size_class(numel):
        """numel rounded up to a multiple of an eighth of its highest power of two (at least 1)."""
        step = max(1, (1 << (max(numel, 1).bit_length() - 1)) // 8)
        return -(-numel // step) * step

    def take(self, dtype, numel):
        """A buffer of at least numel elements (its first numel are the caller's)."""
        length = self.size_class(numel)
        with self._lock:
            free = self._free.get((dtype, length))
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_ids.discard(id(buffer))
                self._free_bytes -= buffer.element_size() * length
        if buffer is None:
            buffer = torch.empty(length, dtype=dtype, device="cpu", pin_memory=self._pin)
            self.buffers_made += 1
            self.bytes_made += buffer.element_size() * length
        with self._lock:
            self._in_use_bytes += buffer.element_size() * length
            self._peak_in_use_bytes = max(self._peak_in_use_bytes, self._in_use_bytes)
        return buffer

    def give_back(self, buffer):
        key = (buffer.dtype, buffer.numel())
        with self._lock:
            self._in_use_bytes -= buffer.element_size() * buffer.numel()
            self._free.setdefault(key, []).append(buffer)
            self._given_back.append((key, buffer))
            self._free_ids.add(id(buffer))
            self._free_bytes += buffer.element_size() * buffer.numel()
            while self._free_bytes > self._peak_in_use_bytes and self._given_back:
                old_key, old = self._given_back.popleft()
                if id(old) not in self._free_ids:
                    continue  # taken again since it came back
                self._free_ids.discard(id(old))
                self._free[old_key] = [b for b in self._free[old_key] if b is not old]
                self._free_bytes -= old.element_size() * old.numel()

    def free_bytes(self):
        with self._lock:
            return self._free_bytes


def _span(tensor):
    """The flat stretch of the tensor's storage its elements lie in (an expanded or strided view keeps its
    layout: the stretch is copied and the view made again on it)."""
    length = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.as_strided((length,), (1,), tensor.storage_offset())


class _CudaCopies:
    """The copies on a GPU: one copy stream, ordered against torch's current one by events."""

    pin = True

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def moves(self, tensor):
        return tensor.device == self.device

    def to_host(self, tensor, host, checkpoint):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it

    def to_device(self, host, checkpoint):
        # Allocated on the copy stream: a block torch's stream freed may still be read by its queued kernels,
        # and the copy does not wait for them.
        with torch.cuda.stream(self.stream):
            tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            tensor.copy_(host, non_blocking=True)
            fetched = torch.cuda.Event()
            fetched.record(self.stream)
        return tensor, fetched

    def hand_over(self, tensor, fetched, checkpoint):
        current = torch.cuda.current_stream(self.device)
        current.wait_event(fetched)
        tensor.record_stream(current)  # freed by torch's stream's work: not reused before it has run

    def synchronize(self):
        torch.cuda.synchronize(self.device)


class _RecordedCopies:
    """The cuda order played on the cpu device (tests): clones for copies, a log of every copy and wait."""

    pin = False

    def __init__(self):
        self.log = []

    def moves(self, tensor):
        return tensor.device.type == "cpu"

    def to_host(self, tensor, host, checkpoint):
        host.copy_(tensor)
        self.log.append(("to_host", checkpoint))

    def to_device(self, host, checkpoint):
        self.log.append(("to_device", checkpoint))
        return host.clone(), checkpoint

    def hand_over(self, tensor, fetched, checkpoint):
        self.log.append(("wait", checkpoint))

    def synchronize(self):
        self.log.append(("synchronize", None))


class _Packed:
    """One checkpoint input in host memory, and its fetched device copy once asked for."""

    __slots__ = ("host", "shape", "stride", "checkpoint", "source", "version", "device_copy", "fetched",
                 "fetched_once", "__weakref__")

    def __init__(self, host, like, checkpoint):
        self.host = host  # the pool buffer's first elements: the flat stretch (_span) of the input
        self.shape, self.stride = like.shape, like.stride()
        self.checkpoint = checkpoint  # the number of the checkpoint whose input it is
        self.source = weakref.ref(like)  # to see an in-place write to the input after it was saved
        self.version = like._version
        self.device_copy = None
        self.fetched = None        # the event the copy back records
        self.fetched_once = False


class ActivationOffload:
    """The pack / unpack pair around a checkpoint's saved inputs (Note [Activation checkpoints in host memory])."""

    def __init__(self, copies):
        self.copies = copies
        self.pool = HostBufferPool(copies.pin)
        self._live = {}        # checkpoint number -> weakrefs to its packed inputs, in the order they were packed
        self._checkpoints = 0  # checkpoints begun (hooks() entered)
        self._current = None   # the checkpoint whose inputs are being packed
        self.offloaded_bytes = 0
        self.fetched_bytes = 0

    @contextlib.contextmanager
    def hooks(self):
        """Within the block, tensors saved for backward go through pack / unpack."""
        outer, self._current = self._current, self._checkpoints
        self._checkpoints += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._current = outer

    def pack(self, tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.numel() == 0 or not self.copies.moves(tensor):
            return tensor
        span = _span(tensor)
        buffer = self.pool.take(span.dtype, span.numel())
        packed = _Packed(buffer[:span.numel()], tensor, self._current)
        self.copies.to_host(span, packed.host, packed.checkpoint)
        self.offloaded_bytes += span.element_size() * span.numel()
        weakref.finalize(packed, self.pool.give_back, buffer)
        self._live.setdefault(self._current, []).append(weakref.ref(packed))
        return packed

    def unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        written = packed.source()
        if written is not None and written._version != packed.version:
            # What torch's own saved tensors check: the recompute would read other values than the forward did.
            raise RuntimeError(f"an input of activation checkpoint {packed.checkpoint} (shape {tuple(packed.shape)}) "
                               f"was modified in place after the checkpoint saved it (version {packed.version} -> "
                               f"{written._version}): its recompute would not match the forward; clone the input "
                               f"before writing to it")
        if packed.device_copy is None:  # not prefetched, or asked again (backward with retain_graph)
            self._fetch(packed)
        self._fetch_checkpoint(packed.checkpoint)  # its other inputs
        # The checkpoint before it runs backward next: its inputs' copies overlap this recompute.
        self._fetch_checkpoint(self._checkpoint_before(packed.checkpoint))
        self.copies.hand_over(packed.device_copy, packed.fetched, packed.checkpoint)
        tensor = packed.device_copy.as_strided(packed.shape, packed.stride)
        packed.device_copy = packed.fetched = None  # a second unpack (retain_graph) fetches again
        return tensor  # autograd gives it back its place in the graph

    def _live_of(self, checkpoint):
        """The checkpoint's packed inputs still alive; a checkpoint with none left is forgotten."""
        refs = self._live.get(checkpoint, [])
        alive = [packed for packed in (ref() for ref in refs) if packed is not None]
        if not alive:
            self._live.pop(checkpoint, None)
        return alive

    def _fetch_checkpoint(self, checkpoint):
        if checkpoint is None:
            return
        for packed in self._live_of(checkpoint):
            if not packed.fetched_once:
                self._fetch(packed)

    def _fetch(self, packed):
        packed.device_copy, packed.fetched = self.copies.to_device(packed.host, packed.checkpoint)
        packed.fetched_once = True
        self.fetched_bytes += packed.host.element_size() * packed.host.numel()

    def _checkpoint_before(self, checkpoint):
        """The last checkpoint begun before `checkpoint` that still has inputs in host memory, or None."""
        for earlier in sorted((c for c in self._live if c < checkpoint), reverse=True):
            if self._live_of(earlier):
                return earlier
        return None

    def stats(self):
        return {"offloaded_bytes": self.offloaded_bytes, "fetched_bytes": self.fetched_bytes,
                "pinned_buffers": self.pool.buffers_made, "pinned_bytes": self.pool.bytes_made}


def cuda_offload(device):
    return ActivationOffload(_CudaCopies(device))


def recorded_offload():
    return ActivationOffload(_RecordedCopies())
