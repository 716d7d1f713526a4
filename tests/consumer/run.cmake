# Installs the duet of DUET_BUILD_DIR into a fresh prefix, then configures, builds and runs the
# consumer project against that prefix alone.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${DUET_BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "installing duet failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer against the installed duet failed")
endif()
# Its programs side by side: this test ends CI's gcc stage, the other job slot idle.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build --parallel 2 RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer's graph and PyNative outputs differ")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer_inline_kernels OUTPUT_VARIABLE inline RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer_inline_kernels failed")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer_precompiled_kernels OUTPUT_VARIABLE precompiled RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer_precompiled_kernels failed")
endif()
if(NOT inline STREQUAL precompiled)
  message(FATAL_ERROR "duet::kernels changed the results:\n header-only:\n${inline}\n precompiled:\n${precompiled}")
endif()
