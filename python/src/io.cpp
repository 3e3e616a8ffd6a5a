// Bindings of nvme's IoEngine and SwapStore. Buffers are raw addresses the
// Python layer took from a tensor (data_ptr) or an array; the native handle
// holds that object until the request is done, and a handle dropped before
// then waits for it (the buffer must outlive the I/O writing into it).
// Handles keep their engine (and store) alive, so waiting on a handle after
// the Python object that made it is gone is safe. Every wait, synchronous
// read/write and verification releases the GIL.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "errors.h"
#include "strata/core/printable.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_dir.h"
#include "strata/nvme/swap_store.h"

namespace strata::python {
namespace {

using namespace strata::nvme;

std::byte* as_bytes(uintptr_t address) { return reinterpret_cast<std::byte*>(address); }

// True once the interpreter is shutting down: a thread that gives the GIL
// up then cannot take it back (CPython ends it), so waits there keep it.
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

Status wait_released(const Completion& completion) {
  if (interpreter_finalizing()) return completion.wait();
  py::gil_scoped_release release;
  return completion.wait();
}

// One request in flight and what must outlive it: the engine (or store)
// that runs it and the Python object owning its buffer. Destroyed (its last
// handle gone, the GIL held) before the request is done, it waits for it
// with the GIL released, then lets the buffer go; the request's error, if
// any, is the dropped handle's to report and is not raised from here.
template <class Handle, class Runner>
struct InFlight {
  Handle handle;
  Runner runner;
  py::object buffer_owner;

  InFlight(Handle h, Runner r, py::object owner)
      : handle(std::move(h)), runner(std::move(r)), buffer_owner(std::move(owner)) {}
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() {
    if (!handle.done()) (void)wait_released(handle.completion());
  }
};

struct PyIoHandle {
  std::shared_ptr<InFlight<IoHandle, std::shared_ptr<IoEngine>>> request;

  void wait() const { throw_if_error(wait_released(request->handle.completion())); }
  bool done() const { return request->handle.done(); }
  uint64_t bytes() const { return request->handle.bytes(); }
};

class PyIoEngine {
 public:
  PyIoEngine(const std::string& engine, uint64_t block_size, uint32_t queue_depth, uint32_t threads, bool direct_io) {
    IoEngineOptions options;
    options.engine = value_or_raise(parse_engine_kind(engine, "engine"));
    options.block_size = block_size;
    options.queue_depth = queue_depth;
    options.intra_op_parallelism = threads;
    options.direct_io = direct_io;
    throw_if_error(options.validate());
    engine_ = value_or_raise(make_io_engine(options));
  }

  FileId open(const std::string& path, const std::string& mode) {
    OpenMode m;
    if (mode == "r") {
      m = OpenMode::kRead;
    } else if (mode == "r+") {
      m = OpenMode::kReadWrite;
    } else if (mode == "w") {
      m = OpenMode::kCreate;
    } else {
      raise_status(InvalidArgument(fmt::format("open {}: mode '{}' is not 'r', 'r+' or 'w' (create)", path, mode)));
    }
    return value_or_raise(engine_->open(path, m));
  }
  void close(FileId file) { throw_if_error(engine_->close(file)); }

  py::dict file_info(FileId file) const {
    FileInfo info = value_or_raise(engine_->file_info(file));
    py::dict d;
    d["path"] = info.path;
    d["direct"] = info.direct;
    d["direct_alignment"] = info.direct_alignment;
    d["writable"] = info.writable;
    d["fallback_reason"] = info.fallback_reason;
    return d;
  }

  // `buffer_owner`: the object whose memory `buffer` points into, held
  // until the request is done.
  PyIoHandle submit(const std::string& op, FileId file, uint64_t offset, uint64_t length, uintptr_t buffer,
                    py::object buffer_owner) {
    if (op != "read" && op != "write")
      raise_status(InvalidArgument(fmt::format("submit: op {} is not 'read' or 'write'", printable(op, 16))));
    IoSegment segment{.file = file, .offset = offset, .length = length, .buffer = as_bytes(buffer)};
    IoOp io_op = op == "read" ? IoOp::kRead : IoOp::kWrite;
    IoHandle handle;
    {
      py::gil_scoped_release release;
      handle = engine_->submit(io_op, std::span<const IoSegment>(&segment, 1));
    }
    return PyIoHandle{std::make_shared<InFlight<IoHandle, std::shared_ptr<IoEngine>>>(std::move(handle), engine_,
                                                                                      std::move(buffer_owner))};
  }

  std::string kind() const { return std::string(engine_kind_name(engine_->kind())); }
  std::string describe() const { return engine_->describe(); }
  std::vector<std::string> notes() const { return engine_->notes(); }
  py::dict stats() const {
    IoEngineStats s = engine_->stats();
    py::dict d;
    d["requests"] = s.requests;
    d["pieces"] = s.pieces;
    d["bytes_read"] = s.bytes_read;
    d["bytes_written"] = s.bytes_written;
    d["direct_pieces"] = s.direct_pieces;
    d["buffered_pieces"] = s.buffered_pieces;
    d["short_resubmits"] = s.short_resubmits;
    d["transient_retries"] = s.transient_retries;
    d["failed_requests"] = s.failed_requests;
    return d;
  }
  const std::shared_ptr<IoEngine>& engine() const { return engine_; }

 private:
  std::shared_ptr<IoEngine> engine_;
};

// The store and the engine it needs, destroyed store first.
struct StoreHolder {
  std::shared_ptr<IoEngine> engine;
  std::unique_ptr<SwapStore> store;
};

struct PySwapHandle {
  std::shared_ptr<InFlight<SwapHandle, std::shared_ptr<StoreHolder>>> request;

  void wait() const { throw_if_error(wait_released(request->handle.completion())); }
  bool done() const { return request->handle.done(); }
};

class PySwapStore {
 public:
  PySwapStore(const PyIoEngine& engine, const std::vector<std::string>& paths, uint64_t capacity_bytes,
              const std::string& job, int rank, uint64_t checksum_block_bytes, uint64_t index_bytes,
              bool verify_checksums, bool verify_writes, bool keep_files, bool open_existing) {
    SwapStoreOptions options;
    options.paths = paths;
    options.capacity_bytes = capacity_bytes;
    options.job = job;
    options.rank = rank;
    options.checksum_block_bytes = checksum_block_bytes;
    options.index_bytes = index_bytes;
    options.verify_checksums = verify_checksums;
    options.verify_writes = verify_writes;
    options.keep_files = keep_files;
    options.open_existing = open_existing;
    holder_ = std::make_shared<StoreHolder>();
    holder_->engine = engine.engine();
    Result<std::unique_ptr<SwapStore>> store = InvalidArgument("unreached");
    {
      py::gil_scoped_release release;
      store = SwapStore::open(options, *holder_->engine);
    }
    holder_->store = value_or_raise(std::move(store));
  }

  // `owner`: the object whose memory `data` points into, held until done.
  PySwapHandle write(TensorId id, uintptr_t data, uint64_t bytes, py::object owner) {
    return wrap(store().write(id, as_bytes(data), bytes), std::move(owner));
  }
  PySwapHandle read(TensorId id, uintptr_t data, uint64_t bytes, py::object owner) {
    return wrap(store().read(id, as_bytes(data), bytes), std::move(owner));
  }
  PySwapHandle write_range(TensorId id, uint64_t offset, uintptr_t data, uint64_t bytes, py::object owner) {
    return wrap(store().write_range(id, offset, std::span<const std::byte>(as_bytes(data), bytes)), std::move(owner));
  }
  PySwapHandle read_range(TensorId id, uint64_t offset, uintptr_t data, uint64_t bytes, py::object owner) {
    return wrap(store().read_range(id, offset, std::span<std::byte>(as_bytes(data), bytes)), std::move(owner));
  }
  void remove(TensorId id) { throw_if_error(store().remove(id)); }
  bool contains(TensorId id) { return store().contains(id); }
  uint64_t size_of(TensorId id) { return value_or_raise(store().size_of(id)); }
  std::pair<uint64_t, uint64_t> extent_of(TensorId id) {
    Extent e = value_or_raise(store().extent_of(id));
    return {e.offset, e.length};
  }
  std::vector<TensorId> ids() { return store().ids(); }
  uint64_t checksum_block_bytes() { return store().checksum_block_bytes(); }
  std::vector<std::string> file_paths() { return store().file_paths(); }
  void verify_all() {
    SwapStore& s = store();
    Status st;
    {
      py::gil_scoped_release release;
      st = s.verify_all();
    }
    throw_if_error(st);
  }
  void flush() { throw_if_error(store().flush()); }
  void close() {
    if (!holder_ || !holder_->store) return;
    Status st;
    {
      py::gil_scoped_release release;
      st = holder_->store->close();
    }
    throw_if_error(st);
    holder_->store.reset();
  }
  bool closed() const { return !holder_ || !holder_->store; }
  py::dict stats() {
    SwapStats s = store().stats();
    py::dict d;
    d["tensors"] = s.tensors;
    d["bytes_used"] = s.bytes_used;
    d["bytes_free"] = s.bytes_free;
    d["bytes_written"] = s.bytes_written;
    d["bytes_read"] = s.bytes_read;
    d["verify_failures"] = s.verify_failures;
    d["write_verify_failures"] = s.write_verify_failures;
    d["flips"] = s.flips;
    return d;
  }

 private:
  SwapStore& store() {
    if (closed()) raise_status(FailedPrecondition("swap store is closed"));
    return *holder_->store;
  }
  PySwapHandle wrap(Result<SwapHandle>&& handle, py::object owner) {
    return PySwapHandle{std::make_shared<InFlight<SwapHandle, std::shared_ptr<StoreHolder>>>(
        value_or_raise(std::move(handle)), holder_, std::move(owner))};
  }

  std::shared_ptr<StoreHolder> holder_;
};

}  // namespace

void bind_io(py::module_& m) {
  py::class_<PyIoHandle>(m, "IoHandle", "Completion of one read or write request")
      .def("wait", &PyIoHandle::wait, "Blocks (GIL released) until done; raises the request's error")
      .def("done", &PyIoHandle::done)
      .def_property_readonly("bytes", &PyIoHandle::bytes);
  py::class_<PyIoEngine>(m, "IoEngine", "nvme IoEngine: io_uring, libaio or psync")
      .def(py::init<const std::string&, uint64_t, uint32_t, uint32_t, bool>(), py::arg("engine") = "auto",
           py::arg("block_size") = 1u << 20, py::arg("queue_depth") = 8, py::arg("threads") = 1,
           py::arg("direct_io") = true)
      .def("open", &PyIoEngine::open, py::arg("path"), py::arg("mode"))
      .def("close", &PyIoEngine::close, py::arg("file"))
      .def("file_info", &PyIoEngine::file_info, py::arg("file"))
      .def("submit", &PyIoEngine::submit, py::arg("op"), py::arg("file"), py::arg("offset"), py::arg("length"),
           py::arg("buffer"), py::arg("buffer_owner"))
      .def_property_readonly("kind", &PyIoEngine::kind)
      .def("describe", &PyIoEngine::describe)
      .def("notes", &PyIoEngine::notes)
      .def("stats", &PyIoEngine::stats);
  m.def("choose_engine", [] {
    EngineChoice c = choose_engine();
    return std::pair<std::string, std::string>(std::string(engine_kind_name(c.kind)), c.reason);
  });

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol(), "Aligned (optionally mlock'ed) host memory")
      .def(py::init([](size_t bytes, size_t alignment, bool pin) {
             return value_or_raise(AlignedBuffer::allocate(bytes, alignment, pin));
           }),
           py::arg("bytes"), py::arg("alignment") = 4096, py::arg("pin") = false)
      .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("size", &AlignedBuffer::size)
      .def_property_readonly("alignment", &AlignedBuffer::alignment)
      .def_property_readonly("pinned", &AlignedBuffer::pinned)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  py::class_<PySwapHandle>(m, "SwapHandle", "Completion of one swap read or write (after checksum verification)")
      .def("wait", &PySwapHandle::wait)
      .def("done", &PySwapHandle::done);
  py::class_<PySwapStore>(m, "SwapStore", "nvme SwapStore: checksummed tensors by id")
      .def(py::init<const PyIoEngine&, const std::vector<std::string>&, uint64_t, const std::string&, int, uint64_t,
                    uint64_t, bool, bool, bool, bool>(),
           py::arg("engine"), py::arg("paths"), py::arg("capacity_bytes"), py::arg("job") = "default",
           py::arg("rank") = 0, py::arg("checksum_block_bytes") = 64u << 10, py::arg("index_bytes") = 0,
           py::arg("verify_checksums") = true, py::arg("verify_writes") = true, py::arg("keep_files") = false,
           py::arg("open_existing") = false)
      .def("write", &PySwapStore::write)
      .def("read", &PySwapStore::read)
      .def("write_range", &PySwapStore::write_range)
      .def("read_range", &PySwapStore::read_range)
      .def("remove", &PySwapStore::remove)
      .def("contains", &PySwapStore::contains)
      .def("size_of", &PySwapStore::size_of)
      .def("extent_of", &PySwapStore::extent_of)
      .def("ids", &PySwapStore::ids)
      .def_property_readonly("checksum_block_bytes", &PySwapStore::checksum_block_bytes)
      .def("file_paths", &PySwapStore::file_paths)
      .def("verify_all", &PySwapStore::verify_all)
      .def("flush", &PySwapStore::flush)
      .def("close", &PySwapStore::close)
      .def_property_readonly("closed", &PySwapStore::closed)
      .def("stats", &PySwapStore::stats);
  // The swap folders under an nvme path as `strata swap list` and `strata report --path` see them
  // (nvme/swap_dir.h: a folder whose lock no live process holds is stale); nothing is changed.
  m.def(
      "swap_folders",
      [](const std::string& nvme_path) {
        Result<std::vector<SwapFolder>> listed = [&] {
          py::gil_scoped_release unlocked;
          return list_swap_folders(nvme_path);
        }();
        // Names as os.fsdecode gives them: a folder's name need not be UTF-8.
        const auto fs_text = [](const std::string& text) {
          py::object decoded = py::reinterpret_steal<py::object>(
              PyUnicode_DecodeFSDefaultAndSize(text.data(), static_cast<py::ssize_t>(text.size())));
          if (!decoded) throw py::error_already_set();
          return decoded;
        };
        py::list out;
        for (const SwapFolder& f : value_or_raise(std::move(listed))) {
          py::dict d;
          d["path"] = fs_text(f.path);
          d["job"] = fs_text(f.job);
          d["rank"] = f.rank;
          d["state"] = std::string(swap_folder_state_name(f.state));
          d["pid"] = f.pid;
          d["host"] = fs_text(f.host);
          d["bytes"] = f.bytes;
          out.append(d);
        }
        return out;
      },
      py::arg("nvme_path"));
}

}  // namespace strata::python
