# Fails when an executable depends on a library it must not: used to prove that the config reader
# and the planner (strata_config, strata_plan) link no IO, threading-pool or communication library.
# Usage: cmake -DEXE=<file> -DFORBIDDEN=gloo,uring,tbb -P check_links.cmake
# Checks both the dynamic dependencies (readelf -d NEEDED) and the symbols (nm), so a library
# linked statically is caught too.
execute_process(COMMAND readelf -d ${EXE} OUTPUT_VARIABLE needed RESULT_VARIABLE rc1)
execute_process(COMMAND nm -C ${EXE} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc2)
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "check_links: could not read ${EXE} (readelf ${rc1}, nm ${rc2})")
endif()
string(REPLACE "," ";" FORBIDDEN "${FORBIDDEN}")
set(bad "")
foreach(lib IN LISTS FORBIDDEN)
  if(needed MATCHES "NEEDED[^\n]*lib${lib}")
    list(APPEND bad "needs lib${lib}")
  endif()
endforeach()
foreach(sym IN ITEMS "gloo::" "io_uring_" "tbb::" "hwloc_" "nccl" "cudaMalloc")
  string(FIND "${symbols}" "${sym}" at)
  if(NOT at EQUAL -1)
    list(APPEND bad "has symbols ${sym}*")
  endif()
endforeach()
if(bad)
  message(FATAL_ERROR "check_links: ${EXE}: ${bad}")
endif()
message(STATUS "check_links: ${EXE} links none of: ${FORBIDDEN}")
