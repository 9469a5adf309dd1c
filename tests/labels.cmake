# Read by ctest after the gtest cases are discovered (CMakeLists.txt): the labels, timeout and environment of each
# group. The timeouts leave room for the sanitizer build (3-5x slower than Release) and a loaded machine: the
# longest case of each group takes ~2 s (unit), ~5 s (integration) and ~10 s (slow) in Release on 2 cores.
set(hs_env "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive")
foreach(group unit integration slow)
  if(group STREQUAL "unit")
    set(labels unit)
    set(timeout 200)
  elseif(group STREQUAL "integration")
    set(labels integration)
    set(timeout 400)
  else()
    set(labels integration slow)
    set(timeout 900)
  endif()
  foreach(t IN LISTS hs_${group}_tests)
    set_tests_properties("${t}" PROPERTIES LABELS "${labels}" TIMEOUT ${timeout} ENVIRONMENT "${hs_env}")
  endforeach()
endforeach()
