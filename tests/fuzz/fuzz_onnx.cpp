// libFuzzer harness for the ONNX loader (duet/io/onnx.hpp). Any bytes must either build a
// network or throw a duet::Error; a network that builds is run on a batch of each input rank
// the loader's operators take, and must either give a tensor or throw a duet::Error. Anything
// else is a bug: a sanitizer report, another exception (left uncaught, so libFuzzer reports it),
// a hang, or an allocation beyond -malloc_limit_mb. The seed corpus (corpus/onnx) is small
// models of every operator the loader reads and the inputs that once crashed it (broken_*),
// written by make_onnx_corpus.py; onnx.dict has the names and sizes a model spells.
#include <cstddef>
#include <cstdint>
#include <duet/duet.hpp>
#include <duet/io/onnx.hpp>
#include <span>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    duet::io::OnnxModel net = duet::io::load_onnx_bytes(std::as_bytes(std::span(data, size)));
    for (const duet::Shape& shape : {duet::Shape{2, 4}, duet::Shape{1, 2, 6, 6}}) {
      try {
        static_cast<void>(net(duet::ones(shape)));
      } catch (const duet::Error&) {
      }
    }
  } catch (const duet::Error&) {
  }
  return 0;
}
