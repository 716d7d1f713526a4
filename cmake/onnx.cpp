// duet::onnx: the ONNX loader's definitions (duet/io/onnx.hpp, detail/onnx_import.hpp), compiled
// once for the programs that link the target (it sets DUET_ONNX_LIBRARY for them).
#define DUET_DEFINE_ONNX_LIBRARY
#include <duet/io/onnx.hpp>
