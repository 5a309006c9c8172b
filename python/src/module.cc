// strata._strata: the native module of the strata Python package (python/strata).
#include <nanobind/nanobind.h>

#include "python/src/binding_util.h"

namespace nb = nanobind;

namespace strata::python {
void BindConfig(nb::module_& m);
void BindEngine(nb::module_& m);
}  // namespace strata::python

NB_MODULE(_strata, m) {
  m.doc() = "strata's native module: the config checker, the planner and the ZeRO engine";
  nb::exception<strata::python::StatusError>(m, "StrataError", PyExc_RuntimeError);
  strata::python::BindConfig(m);
  strata::python::BindEngine(m);
}
