// spillway._C: the Python face of the torch layer. The package `spillway` wraps it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
#include <string>

#include "allocator/config.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "capi/process_allocator.h"
#include "hooks/cuda_allocator.h"
#include "hooks/runtime.h"
#include "hooks/saved_tensors.h"
#include "hooks/snapshot.h"
#include "hooks/storage_tools.h"

namespace py = pybind11;
namespace sw = spillway;
namespace tl = spillway::torch_layer;

namespace {

sw::OffloadPolicy ParsePolicy(const std::string& name) {
  if (name == "off") return sw::OffloadPolicy::kOff;
  if (name == "eager") return sw::OffloadPolicy::kEager;
  if (name == "auto") return sw::OffloadPolicy::kAuto;
  throw sw::InvalidArgumentError("bad offload policy '" + name +
                                 "': expected one of off, eager, auto");
}

py::dict MemoryStats(int device) {
  tl::Runtime& runtime = tl::Runtime::Get();
  py::dict out;
  for (const auto& [key, value] : runtime.allocator().FlatStats(device)) out[py::str(key)] = value;
  for (const auto& [key, value] : runtime.engine().stats().Flatten()) {
    out[py::str("spillway." + key)] = value;
  }
  return out;
}

void ConfigureOffload(const std::string& policy, int64_t budget_bytes, double budget_fraction,
                      int64_t min_bytes, std::optional<int64_t> prefetch_bytes) {
  tl::Runtime& runtime = tl::Runtime::Get();
  sw::OffloadConfig config = runtime.engine().config();
  config.policy = ParsePolicy(policy);
  auto non_negative = [](const char* name, int64_t value) {
    if (value < 0) {
      throw sw::InvalidArgumentError(std::string("bad value ") + std::to_string(value) + " for " +
                                     name + ": expected a non-negative number of bytes");
    }
    return static_cast<size_t>(value);
  };
  config.budget_bytes = non_negative("budget_bytes", budget_bytes);
  config.budget_fraction = budget_fraction;
  config.min_bytes = non_negative("min_bytes", min_bytes);
  // None: adaptive (see OffloadConfig::prefetch_bytes).
  config.prefetch_bytes.reset();
  if (prefetch_bytes) config.prefetch_bytes = non_negative("prefetch_bytes", *prefetch_bytes);
  runtime.engine().SetConfig(config);
}

// An unset byte count (adaptive) is None in Python.
py::object OptionalBytes(const std::optional<size_t>& bytes) {
  return bytes ? py::int_(*bytes) : py::object(py::none());
}

py::dict OffloadConfigDict(const sw::OffloadConfig& c) {
  py::dict d;
  d["policy"] = std::string(sw::OffloadPolicyName(c.policy));
  d["budget_bytes"] = c.budget_bytes;
  d["budget_fraction"] = c.budget_fraction;
  d["min_bytes"] = c.min_bytes;
  d["prefetch_bytes"] = OptionalBytes(c.prefetch_bytes);
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Spillway's torch layer (C++).";
  // pybind11 takes translators as void(*)(std::exception_ptr): by value, as it requires.
  py::register_exception_translator(
      [](std::exception_ptr p) {  // NOLINT(performance-unnecessary-value-param)
        try {
          if (p) std::rethrow_exception(p);
        } catch (const sw::InvalidArgumentError& e) {
          PyErr_SetString(PyExc_ValueError, e.what());
        }
      });

  m.def(
      "install",
      [](const std::string& device, const std::string& conf, size_t capacity_bytes) {
        tl::Runtime::Get().Install(device, conf, capacity_bytes);
      },
      py::arg("device"), py::arg("conf"), py::arg("capacity_bytes") = 0);
  m.def("has_cuda_allocator", &tl::HasCudaAllocator);
  m.def("install_cuda_allocator", [] {
    tl::Runtime& runtime = tl::Runtime::Get();
    if (runtime.mode() != tl::Mode::kCuda) {
      throw sw::InvalidArgumentError(
          "install_cuda_allocator: install Spillway for device \"cuda\" first");
    }
    sw::CachingAllocator& allocator = runtime.allocator();
    tl::InstallCudaAllocator(allocator, [&runtime, &allocator] { runtime.EmptyCache(allocator); });
  });
  m.def("abandon_cuda_install", [] { tl::Runtime::Get().AbandonCudaInstall(); });
  m.def("installed_mode", [] {
    switch (tl::Runtime::Get().mode()) {
      case tl::Mode::kSim:
        return std::string("sim");
      case tl::Mode::kCuda:
        return std::string("cuda");
      case tl::Mode::kNone:
        break;
    }
    return std::string();
  });
  // The configured offload settings, and the ones in force now (an offload block sets them).
  m.def("offload_defaults", [] { return OffloadConfigDict(tl::Runtime::Get().config().offload); });
  m.def("offload_config", [] { return OffloadConfigDict(tl::Runtime::Get().engine().config()); });
  m.def("configure_offload", &ConfigureOffload);
  // What the environment hook needs to know of a configuration string, from the one parser:
  // the device, and the offload policy if the string names one (None otherwise).
  m.def("describe_config", [](const std::string& conf) {
    sw::Config off_base;
    off_base.offload.policy = sw::OffloadPolicy::kOff;
    sw::Config eager_base;
    eager_base.offload.policy = sw::OffloadPolicy::kEager;
    const absl::StatusOr<sw::Config> a = sw::ParseConfig(conf, off_base);
    if (!a.ok()) throw sw::InvalidArgumentError(std::string(a.status().message()));
    const absl::StatusOr<sw::Config> b = sw::ParseConfig(conf, eager_base);
    py::dict d;
    d["device"] = a->device == sw::DeviceKind::kSim ? "sim" : "cuda";
    // A policy the string does not name follows the base: the two parses then differ.
    if (a->offload.policy == b->offload.policy) {
      d["offload"] = std::string(sw::OffloadPolicyName(a->offload.policy));
    } else {
      d["offload"] = py::none();
    }
    d["budget_bytes"] = a->offload.budget_bytes;
    d["budget_fraction"] = a->offload.budget_fraction;
    d["min_bytes"] = a->offload.min_bytes;
    d["prefetch_bytes"] = OptionalBytes(a->offload.prefetch_bytes);
    return d;
  });
  m.def("budget_bytes",
        [](int device) { return tl::Runtime::Get().engine().budget_bytes(device); });

  py::class_<tl::SavedHandle, std::shared_ptr<tl::SavedHandle>>(m, "SavedHandle")
      .def_property_readonly("managed", &tl::SavedHandle::managed)
      .def("__repr__", [](const tl::SavedHandle& h) {
        return "<spillway.SavedHandle " + h.Describe() + (h.managed() ? " managed>" : " kept>");
      });
  // What a save kept as it is in Python (a tensor subclass) holds: release() and keepers() see
  // the save as long as the object lives.
  py::class_<tl::KeptRegistration>(m, "KeptRegistration")
      .def(py::init<const at::Tensor&>())
      .def("__len__", &tl::KeptRegistration::size);
  // pack(tensor[, off, min_bytes]): the settings of the offload block open on the saving thread
  // (another thread's may be the engine's now); without them, the engine's configuration.
  m.def(
      "pack",
      [](const at::Tensor& tensor, std::optional<bool> off, std::optional<size_t> min_bytes) {
        if (off.has_value() != min_bytes.has_value()) {
          throw py::value_error("pack: give off and min_bytes together, or neither");
        }
        std::optional<spillway::SaveSettings> settings;
        if (off.has_value()) settings = spillway::SaveSettings{*off, *min_bytes};
        return tl::Pack(tensor, settings);
      },
      py::arg("tensor"), py::arg("off") = py::none(), py::arg("min_bytes") = py::none());
  m.def("unpack", &tl::Unpack);
  m.def("forward_end", &tl::ForwardEnd);
  m.def("count_skip",
        [](const std::string& reason) { tl::Runtime::Get().engine().CountSkip(reason); });

  m.def("memory_stats", &MemoryStats);
  m.def("reset_peak_stats", [](int device) {
    tl::Runtime& runtime = tl::Runtime::Get();
    runtime.allocator().ResetPeakStats(device);
    if (sw::OffloadEngine* engine = runtime.engine_if_created()) engine->ResetPeakStats();
  });
  m.def("reset_accumulated_stats",
        [](int device) { tl::Runtime::Get().allocator().ResetAccumulatedStats(device); });
  m.def("empty_cache", [] {
    tl::Runtime& runtime = tl::Runtime::Get();
    runtime.EmptyCache(runtime.allocator());
  });
  m.def("synchronize", [] {
    if (sw::OffloadEngine* engine = tl::Runtime::Get().engine_if_created()) engine->Synchronize();
  });
  m.def("keepers", &tl::Keepers);
  m.def("release", &tl::Release);
  m.def("residency", &tl::ResidencyOf);
  m.def("snapshot", &tl::Snapshot);
  m.def("set_memory_fraction", [](double fraction, int device) {
    tl::Runtime::Get().allocator().SetMemoryFraction(fraction, device);
  });
  // Testing only: arms one of the simulated device's fault-injection knobs ("device_malloc",
  // "host_malloc", "copy", "event"; see sim_backend.h).
  m.def("sim_inject_fault", [](const std::string& kind, int64_t n) {
    auto* sim = dynamic_cast<sw::SimBackend*>(&tl::Runtime::Get().allocator().backend());
    if (sim == nullptr)
      throw sw::InvalidArgumentError("sim_inject_fault: not on the simulated device");
    if (kind == "device_malloc") {
      sim->fail_device_malloc_after(n);
    } else if (kind == "host_malloc") {
      sim->fail_host_malloc(n);
    } else if (kind == "copy") {
      sim->fail_copy_after(n);
    } else if (kind == "event") {
      sim->fail_event_after(n);
    } else {
      throw sw::InvalidArgumentError("sim_inject_fault: unknown fault '" + kind +
                                     "': expected device_malloc, host_malloc, copy or event");
    }
  });
  m.def("record_history", &tl::RecordHistory);
  m.def("set_memory_metadata", &tl::SetUserMetadata);
  m.def("get_memory_metadata", &tl::GetUserMetadata);
  m.def("annotate_tensor", &tl::AnnotateTensor);
}
