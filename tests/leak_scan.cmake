# Run by CTest after doctest's list of duet_tests' cases (tests/CMakeLists.txt adds it to
# TEST_INCLUDE_FILES when the tests are built with AddressSanitizer): turns LeakSanitizer's
# scan at exit off for the cases that also run in unit.isa_avx2 and unit.isa_baseline, whole
# suites in one process each, with the scan on, so a leak in them is still reported, twice.
# The scan reads all of the program's data at every exit: with the program at 0.9 GB, 0.2 of
# the 0.5 s each of the 418 cases took to start and stop. The cases that loop over every
# instruction set themselves (the every_isa suite) run only one by one, and keep their scan.
#   DUET_TESTS: the test program (set by the file that includes this one)
if(NOT EXISTS "${DUET_TESTS}")
  return()  # not built yet: doctest's list says so
endif()
execute_process(COMMAND "${DUET_TESTS}" --test-suite-exclude=every_isa --list-test-cases OUTPUT_VARIABLE output
                RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "listing ${DUET_TESTS}'s cases failed (${result}):\n${output}")
endif()
string(REPLACE "\n" ";" output "${output}")
foreach(name IN LISTS output)
  # doctest's header and footer lines are not cases.
  if(name MATCHES "^(\\[doctest\\]|====)" OR name STREQUAL "")
    continue()
  endif()
  # Appended after the runner's own ASAN_OPTIONS, whose last setting of a flag wins.
  set_tests_properties("${name}" PROPERTIES ENVIRONMENT_MODIFICATION "ASAN_OPTIONS=string_append::detect_leaks=0")
endforeach()
