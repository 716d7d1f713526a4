# Compiles one compile-fail program the way the build would (its command line from
# compile_commands.json), checking only: -fsyntax-only still instantiates every template and
# reports what a build would, without generating code, and, unlike a build, it may run beside
# the others. Prints the compiler's diagnostics; fails if the compiler fails.
#   cmake -DCOMMANDS=<compile_commands.json> -DTARGET=<the target> -P run.cmake
file(READ ${COMMANDS} json)
string(JSON count LENGTH "${json}")
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON command GET "${json}" ${i} command)
  if(command MATCHES "/${TARGET}\\.dir/")
    string(JSON directory GET "${json}" ${i} directory)
    break()
  endif()
  unset(command)
endforeach()
if(NOT command)
  message(FATAL_ERROR "no compile command for ${TARGET} in ${COMMANDS}")
endif()
separate_arguments(arguments UNIX_COMMAND "${command}")
execute_process(COMMAND ${arguments} -fsyntax-only WORKING_DIRECTORY ${directory}
                OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
message("${out}")
if(rc)
  message(FATAL_ERROR "the compiler failed")
endif()
