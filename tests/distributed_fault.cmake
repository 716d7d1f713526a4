# Runs one fault case of duet_distributed_tests under mpirun and passes when the job ends
# non-zero within LIMIT seconds with output matching EXPECT.
string(TIMESTAMP start "%s")
execute_process(COMMAND ${COMMAND} "-tc=${CASE}" --no-skip
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT ${LIMIT})
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message("${out}")
if(rc STREQUAL "0")
  message(FATAL_ERROR "'${CASE}': the job exited 0; a fault must end it non-zero")
endif()
if(rc MATCHES "timeout" OR seconds GREATER_EQUAL LIMIT)
  message(FATAL_ERROR "'${CASE}': the job still ran after ${LIMIT} s (${rc})")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "'${CASE}': the output lacks '${EXPECT}'")
endif()
message("'${CASE}': ended with ${rc} after ${seconds} s")
