# Install rules, the CMake package (find_package(strata)), pkg-config and CPack (.deb).
# Included at the end of the top-level CMakeLists.txt, after every target exists.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The libraries a user links, under the strata:: namespace with their short names. The benchmark
# libraries (strata_nvme_bench, strata_kernels_bench) belong to offloadctl and stay internal.
set(_strata_libs strata_zero strata_store strata_plan strata_config strata_sched strata_nvme
                 strata_cpu strata_gpu strata_kernels_cuda strata_kernels)
foreach(_lib IN LISTS _strata_libs)
  string(REPLACE "strata_" "" _short ${_lib})
  set_target_properties(${_lib} PROPERTIES EXPORT_NAME ${_short} VERSION ${PROJECT_VERSION}
                                           SOVERSION ${PROJECT_VERSION_MAJOR})
endforeach()
set_target_properties(strata_headers PROPERTIES EXPORT_NAME headers)

# strata::strata: the whole engine.
add_library(strata_all INTERFACE)
target_link_libraries(strata_all INTERFACE ${_strata_libs} strata_headers)
set_target_properties(strata_all PROPERTIES EXPORT_NAME strata)
add_library(strata::strata ALIAS strata_all)

install(TARGETS ${_strata_libs} strata_headers strata_all
        EXPORT strataTargets
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime
                NAMELINK_COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(TARGETS offloadctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/strata
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/strata/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata COMPONENT dev)

set(_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${_cmake_dir} COMPONENT dev)
if(NOT DEFINED BUILD_SHARED_LIBS)
  set(BUILD_SHARED_LIBS OFF)
endif()
configure_package_config_file(cmake/strataConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/strataConfig.cmake
                              INSTALL_DESTINATION ${_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake
              ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${_cmake_dir} COMPONENT dev)

# pkg-config: the same libraries, in link order, and their dependencies.
set(STRATA_PC_LIBS "")
foreach(_lib IN LISTS _strata_libs)
  string(APPEND STRATA_PC_LIBS " -l${_lib}")
endforeach()
string(STRIP "${STRATA_PC_LIBS}" STRATA_PC_LIBS)
set(STRATA_PC_LIBS_PRIVATE "-lgloo -ltbb -lhwy -lpthread")
set(STRATA_PC_CFLAGS "")
if(STRATA_CUDA)
  set(STRATA_PC_CFLAGS " -DSTRATA_HAVE_CUDA=1 -I${CUDAToolkit_INCLUDE_DIRS}")
  string(APPEND STRATA_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lnccl -lcudart")
endif()
# Static libraries (the default) need their dependencies on every link: they go in Libs and
# Requires. Shared ones carry them: Libs.private and Requires.private.
if(BUILD_SHARED_LIBS)
  set(STRATA_PC_REQUIRES "Requires.private")
  set(STRATA_PC_LIBS_PRIVATE "Libs.private: ${STRATA_PC_LIBS_PRIVATE}")
else()
  set(STRATA_PC_REQUIRES "Requires")
  string(APPEND STRATA_PC_LIBS " ${STRATA_PC_LIBS_PRIVATE}")
  set(STRATA_PC_LIBS_PRIVATE "")
endif()
configure_file(cmake/strata.pc.in ${PROJECT_BINARY_DIR}/strata.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/strata.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# CPack: `cpack -G DEB` in the build folder makes strata_<v>_<arch>.deb (offloadctl, and the
# shared libraries when BUILD_SHARED_LIBS) and strata-dev_<v>_<arch>.deb (headers, static
# libraries, CMake package, pkg-config file). Dependencies are the Debian packages linked.
set(CPACK_PACKAGE_NAME strata)
set(CPACK_PACKAGE_VENDOR "strata developers")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Heterogeneous offload storage engine for large-model training (ZeRO over HBM, DRAM, NVMe)")
set(CPACK_PACKAGE_CONTACT "strata developers <strata@localhost>")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME strata)
set(CPACK_DEBIAN_DEV_PACKAGE_NAME strata-dev)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION science)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS
    "libtbb12, libhwloc15, liburing2, libgloo0, libxxhash0, libhwy1, libssl3, libstdc++6, libc6")
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "strata (= ${PROJECT_VERSION}), libtbb-dev, libhwloc-dev, liburing-dev, libgloo-dev, libxxhash-dev, libhwy-dev, libssl-dev, nlohmann-json3-dev, pkg-config")
if(STRATA_CUDA)
  # CUDA and NCCL come from NVIDIA's toolkit in /usr/local/cuda, not from Debian packages.
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_DESCRIPTION
      "${CPACK_PACKAGE_DESCRIPTION_SUMMARY}\n Built with CUDA: needs the CUDA runtime and NCCL from /usr/local/cuda.")
endif()
include(CPack)
