# Fails when a public header (include/strata/*.h) includes an internal header of the source tree
# or a third-party header a user of the installed library does not need (nlohmann, CLI11,
# liburing, Highway, oneTBB, Gloo, hwloc, xxHash, CUDA, NCCL).
# Usage: cmake -DDIR=<include/strata> -P check_public_headers.cmake
file(GLOB headers "${DIR}/*.h")
set(bad "")
foreach(h IN LISTS headers)
  file(STRINGS "${h}" includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS includes)
    if(line MATCHES "\"(core|cpu|nvme|gpu|sched|kernels|tools|tests)/"
       OR line MATCHES "<(nlohmann|CLI|liburing|hwy|tbb|oneapi|gloo|hwloc|xxhash|cuda|nccl)")
      list(APPEND bad "${h}: ${line}")
    endif()
  endforeach()
endforeach()
list(LENGTH headers n)
if(n EQUAL 0)
  message(FATAL_ERROR "check_public_headers: no headers under ${DIR}")
endif()
if(bad)
  string(REPLACE ";" "\n  " bad "${bad}")
  message(FATAL_ERROR "check_public_headers: internal or third-party includes:\n  ${bad}")
endif()
message(STATUS "check_public_headers: ${n} headers include only the standard library and strata/")
