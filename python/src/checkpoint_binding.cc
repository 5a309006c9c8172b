// strata._strata.read_checkpoint: the fp32 weights of a checkpoint (DeepSpeed's zero_to_fp32),
// streamed from its rank files without an engine: the files are verified (sizes, XXH3; the
// manifest's checksum), then each parameter is read whole through ckpt::RangeReader::ReadFp32
// (the master of a trainable group, a frozen group's params widened). Memory: the result, 4
// bytes per parameter, and the reader's buffers.
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "core/zero/checkpoint_format.h"
#include "python/src/binding_util.h"

namespace nb = nanobind;

namespace strata::python {
namespace {

namespace ckpt = zero::ckpt;

nb::ndarray<nb::numpy, float> ReadParam(ckpt::RangeReader& rd, size_t g, uint64_t offset,
                                        const ckpt::ParamEntry& p) {
  std::vector<size_t> shape;
  uint64_t n = 1;
  for (int64_t d : p.shape) {
    shape.push_back(static_cast<size_t>(d));
    n *= static_cast<uint64_t>(d);
  }
  auto* data = new float[n];
  nb::capsule owner(data, [](void* q) noexcept { delete[] static_cast<float*>(q); });
  {
    nb::gil_scoped_release unlocked;
    ThrowIfError(rd.ReadFp32(g, offset, n, data));
  }
  return nb::ndarray<nb::numpy, float>(data, shape.size(), shape.data(), owner);
}

// (tag, {parameter name: float32 array of its shape}, client state bytes, [names of the
// parameters the save left out]); without the frozen groups' parameters where `exclude_frozen`,
// and always without those of groups left out at save (SaveOptions::exclude_frozen).
nb::tuple ReadCheckpoint(const std::string& dir, const std::string& tag, bool exclude_frozen) {
  ckpt::Manifest m;
  {
    nb::gil_scoped_release unlocked;
    m = ValueOrThrow(ckpt::VerifyCheckpoint(dir, tag));
  }
  const std::string tag_dir = dir + "/" + m.tag;
  ckpt::RangeReader rd(tag_dir, m);
  nb::dict weights;
  nb::list left_out;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    if (m.groups[g].excluded) {
      for (const ckpt::ParamEntry& p : m.groups[g].params) left_out.append(nb::str(p.name.c_str()));
    }
    if (m.groups[g].excluded || (exclude_frozen && !m.groups[g].trainable)) continue;
    uint64_t offset = 0;
    for (const ckpt::ParamEntry& p : m.groups[g].params) {
      nb::ndarray<nb::numpy, float> a = ReadParam(rd, g, offset, p);
      offset += a.size();
      weights[nb::str(p.name.c_str())] = a;
    }
  }
  std::string blob;
  if (m.has_client_state) {
    blob = ValueOrThrow(ckpt::ReadWholeFile(tag_dir + "/" + ckpt::kClientStateName));
  }
  return nb::make_tuple(m.tag, weights, nb::bytes(blob.data(), blob.size()), left_out);
}

}  // namespace

void BindCheckpoint(nb::module_& m) {
  m.def("read_checkpoint", &ReadCheckpoint, nb::arg("dir"), nb::arg("tag") = "",
        nb::arg("exclude_frozen") = false,
        "The verified checkpoint `tag` of `dir` (\"\": the one `latest` names) as (tag, "
        "{parameter name: float32 array}, client state bytes, [parameters the save left out]): "
        "the fp32 masters (a frozen group's params widened, or left out with exclude_frozen), 4 "
        "bytes per parameter, no engine.");
}

}  // namespace strata::python
