// strata._strata: the native module of the strata Python package (python/strata).
#include <nanobind/nanobind.h>

#include "python/src/binding_util.h"

namespace nb = nanobind;

namespace strata::python {
void BindConfig(nb::module_& m);
void BindEngine(nb::module_& m);
void BindCheckpoint(nb::module_& m);
}  // namespace strata::python

NB_MODULE(_strata, m) {
  m.doc() = "strata's native module: the config checker, the planner and the ZeRO engine";
  // The torch adapter ties an Engine into a reference cycle (parameters -> adapter -> Engine);
  // an engine the script never closed is still alive in that cycle at interpreter exit, which
  // nanobind would report as a leak on every such run.
  nb::set_leak_warnings(false);
  nb::exception<strata::python::StatusError>(m, "StrataError", PyExc_RuntimeError);
  strata::python::BindConfig(m);
  strata::python::BindEngine(m);
  strata::python::BindCheckpoint(m);
}
