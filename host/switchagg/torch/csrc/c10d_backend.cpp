// The "switchagg" c10d backend (docs/TORCH.md), a C++ c10d::Backend as torch's third-party backends
// are (the custom process group backend tutorial, oneCCL's and UCC's bindings). c10d's own
// ProcessGroup (SwitchaggProcessGroup: c10d's own, named "switchagg") holds it, so every collective
// reaches it from C++ with the GIL released.
//
// An allreduce the network can sum goes to the Python data plane (switchagg.torch.backend.Network:
// the session, lanes, striping and staging live there, over the C packet engine); the Python side
// calls back when the sum is in place and this completes the Work's future with the GIL released.
// Every other collective goes to the inner gloo backend, C++ to C++: no Python and no GIL on the way,
// so gloo's enqueue is never called with the GIL held (the Python ProcessGroup's trampoline did,
// and deadlocked against a gloo thread that freed a finished work's tensors).
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr const char* kName = "switchagg";

bool pythonAlive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// The Python exception an allreduce failed with (SwitchaggTimeout, SwitchaggError, ...), kept as
// itself: raised again where the work is waited on, it reaches the caller with its own type.
std::exception_ptr asException(const py::object& error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  return std::make_exception_ptr(py::error_already_set());
}

// A network allreduce: completed once by the data plane's callback. Work's own state (wait() with or
// without a timeout, rethrowing the error) and a future (what DDP's reducer and comm hooks chain on).
class NetworkWork : public c10d::Work {
 public:
  NetworkWork(int rank, std::vector<at::Tensor> tensors)
      : Work(rank, c10d::OpType::ALLREDUCE),
        tensors_(std::move(tensors)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()),
            devicesOf(tensors_))) {}

  // Without the GIL: the future's callbacks (DDP's reducer) run here.
  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(tensors_));
    }
    finish(error);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    Work::wait(timeout);  // rethrows the allreduce's error
    future_->wait();  // CUDA: the caller's current streams wait for the copies back
    return true;
  }

  std::vector<at::Tensor> result() override {
    return tensors_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  static std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
    if (!tensors.empty() && tensors[0].is_cuda()) {
      return {tensors[0].device()};
    }
    return {};
  }

  std::vector<at::Tensor> tensors_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class SwitchaggBackend : public c10d::Backend {
 public:
  SwitchaggBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo, py::object network)
      : Backend(rank, size),
        gloo_(std::move(gloo)),
        network_(std::move(network)) {}

  ~SwitchaggBackend() override {
    if (pythonAlive()) {
      py::gil_scoped_acquire gil;
      network_ = py::object();
    } else {
      network_.release();  // the interpreter is gone: nothing left to free it with
    }
  }

  const std::string getBackendName() const override {
    return kName;
  }

  py::object network() const {
    return network_;
  }

  // destroy_process_group() shuts the group's backends down: the data plane closes then, not at
  // exit (Network.shutdown: when a hosting rank waits for its peers first).
  void shutdown() override {
    if (!pythonAlive()) {
      return;
    }
    py::gil_scoped_acquire gil;
    network_.attr("shutdown")();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    if (auto work = startInNetwork("allreduce", tensors, opts.reduceOp)) {
      return work;
    }
    return gloo_->allreduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    if (auto work = startInNetwork("allreduce_coalesced", tensors, opts.reduceOp)) {
      return work;
    }
    return gloo_->allreduce_coalesced(tensors, opts);
  }

  // Everything else is gloo's, counted and logged on the Python side (CallLog) first.
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    delegated("broadcast", tensors);
    return gloo_->broadcast(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    delegated("reduce", tensors);
    return gloo_->reduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    delegated("allgather", inputs);
    return gloo_->allgather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    delegated("_allgather_base", {input});
    return gloo_->_allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    delegated("allgather_coalesced", inputs);
    return gloo_->allgather_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    delegated("allgather_into_tensor_coalesced", inputs);
    return gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    delegated("gather", inputs);
    return gloo_->gather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    delegated("scatter", outputs);
    return gloo_->scatter(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    delegated("reduce_scatter", outputs);
    return gloo_->reduce_scatter(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    delegated("_reduce_scatter_base", {input});
    return gloo_->_reduce_scatter_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    delegated("reduce_scatter_tensor_coalesced", inputs);
    return gloo_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    delegated("alltoall_base", {input});
    return gloo_->alltoall_base(output, input, outputSplits, inputSplits, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    delegated("alltoall", inputs);
    return gloo_->alltoall(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    delegated("send", tensors);
    return gloo_->send(tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    delegated("recv", tensors);
    return gloo_->recv(tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    delegated("recv_anysource", tensors);
    return gloo_->recvAnysource(tensors, tag);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    delegated("barrier", {});
    return gloo_->barrier(opts);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    delegated("monitored_barrier", {});
    gloo_->monitoredBarrier(opts, waitAllRanks);
  }

  void setSequenceNumberForGroup() override {
    gloo_->setSequenceNumberForGroup();
  }

  uint64_t getSequenceNumberForGroup() override {
    return gloo_->getSequenceNumberForGroup();
  }

 private:
  // Starts the allreduce in the network, or returns null if it is gloo's: Network.start says why
  // not (op, dtype, device) and has counted and logged the call either way.
  c10::intrusive_ptr<c10d::Work> startInNetwork(
      const char* op,
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOp& reduceOp) {
    auto work = c10::make_intrusive<NetworkWork>(getRank(), tensors);
    py::gil_scoped_acquire gil;
    // Called once, on the data plane's thread, with the GIL: None when the sum is in place.
    py::cpp_function done([work](const py::object& error) {
      std::exception_ptr failed = error.is_none() ? nullptr : asException(error);
      py::gil_scoped_release nogil;
      work->complete(failed);
    });
    bool started = network_.attr("start")(op, tensors, static_cast<int>(reduceOp.op_), done).cast<bool>();
    if (!started) {
      return {};
    }
    return work;
  }

  void delegated(const char* op, const std::vector<at::Tensor>& tensors) {
    py::gil_scoped_acquire gil;
    py::object first = tensors.empty() ? py::none() : py::cast(tensors[0]);
    network_.attr("delegated")(op, first);
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  py::object network_;
};

// The group's timeout is the Python side's (Network: a call waits for a slow live peer up to it).
c10::intrusive_ptr<c10d::Backend> create(
    int rank,
    int size,
    c10::intrusive_ptr<c10d::Backend> gloo,
    py::object network) {
  return c10::make_intrusive<SwitchaggBackend>(rank, size, std::move(gloo), std::move(network));
}

// c10d's ProcessGroup as torch makes it for a backend, but named: the base class calls every
// out-of-tree backend "custom", which is what DDP's logging data (backend_name), c10d's errors and
// tools that read them would say. Only the name differs; collectives dispatch to the backend.
class SwitchaggProcessGroup : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;

  const std::string getBackendName() const override {
    return kName;
  }
};

// The group c10d's creator function returns (a ProcessGroup subclass: c10d uses it as the group),
// with the backend for each of the devices the backend was registered for.
c10::intrusive_ptr<SwitchaggProcessGroup> group(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int size,
    c10::intrusive_ptr<c10d::Backend> backend,
    const std::vector<std::string>& devices) {
  auto pg = c10::make_intrusive<SwitchaggProcessGroup>(std::move(store), rank, size);
  for (const auto& device : devices) {
    pg->setBackend(c10::Device(device).type(), c10d::ProcessGroup::BackendType::CUSTOM, backend);
  }
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

SwitchaggBackend& ours(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* mine = dynamic_cast<SwitchaggBackend*>(backend.get());
  TORCH_CHECK(mine != nullptr, "not a switchagg backend: ", backend->getBackendName());
  return *mine;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");  // c10d's types (Backend, ReduceOp) are registered there
  m.def("create", &create, "A switchagg c10d Backend around an inner gloo backend and its Python network side");
  m.def("network_of", [](const c10::intrusive_ptr<c10d::Backend>& b) { return ours(b).network(); });
  py::class_<SwitchaggProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<SwitchaggProcessGroup>>(
      m, "SwitchaggProcessGroup");
  m.def("group", &group, "c10d's ProcessGroup named \"switchagg\", holding the backend for these devices");
}
