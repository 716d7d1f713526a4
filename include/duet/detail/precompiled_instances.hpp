// The float and double instances of duet's templates that do not depend on the network (the
// optimisers, checkpoints, ...), as explicit instantiations: declarations (extern template) in a
// program built with DUET_PRECOMPILED_KERNELS, definitions in duet::kernels' file
// (duet/precompiled_kernels.hpp). A member defined in its class is inline and compiled where
// it is used all the same, so the heavy ones are defined after their class.
// No include guard: precompiled_kernels.hpp includes it once, after what it names.

namespace duet {

#define DUET_DETAIL_ELEMENT(T)                                                                                       \
  DUET_DETAIL_INSTANCE class nn::BasicParameter<T>;                                                                  \
  DUET_DETAIL_INSTANCE class nn::BasicDynamicCell<T>;                                                                \
  DUET_DETAIL_INSTANCE void nn::detail::initialize_dense<T, true>(                                                   \
      nn::detail::DenseParameters<T, true>&, const nn::BasicDynamicCell<T>&, std::array<index_t, 2>,                 \
      std::array<index_t, 2>, const nn::DenseOptions<T>&);                                                           \
  DUET_DETAIL_INSTANCE void nn::detail::initialize_dense<T, false>(                                                  \
      nn::detail::DenseParameters<T, false>&, const nn::BasicDynamicCell<T>&, std::array<index_t, 2>,                \
      std::array<index_t, 2>, const nn::DenseOptions<T>&);                                                           \
  DUET_DETAIL_INSTANCE std::optional<std::string> detail::first_difference_between_ranks<T>(                         \
      detail::DataParallelRuntime&, const std::vector<nn::NamedParameter<T>>&, detail::Stream);                      \
  DUET_DETAIL_INSTANCE class nn::BasicOptimizer<T>;                                                                  \
  DUET_DETAIL_INSTANCE class nn::BasicSGD<T, DefaultBackend>;                                                        \
  DUET_DETAIL_INSTANCE class nn::BasicAdam<T, false, DefaultBackend>;                                                \
  DUET_DETAIL_INSTANCE class nn::BasicAdam<T, true, DefaultBackend>;                                                 \
  DUET_DETAIL_INSTANCE void save_checkpoint<T>(nn::BasicDynamicCell<T>&, const std::filesystem::path&);              \
  DUET_DETAIL_INSTANCE void save_checkpoint<T>(nn::BasicDynamicCell<T>&, const std::filesystem::path&,               \
                                               nn::BasicOptimizer<T>&);                                              \
  DUET_DETAIL_INSTANCE CheckpointLoad load_checkpoint<T>(const std::filesystem::path&, nn::BasicDynamicCell<T>&,     \
                                                         CheckpointLoadOptions);                                     \
  DUET_DETAIL_INSTANCE void load_checkpoint<T>(const std::filesystem::path&, nn::BasicDynamicCell<T>&,               \
                                               nn::BasicOptimizer<T>&);                                              \
  DUET_DETAIL_INSTANCE CheckpointLoad load_checkpoint_bytes<T>(std::span<const std::byte>, nn::BasicDynamicCell<T>&, \
                                                               CheckpointLoadOptions);                               \
  DUET_DETAIL_INSTANCE void load_checkpoint_bytes<T>(std::span<const std::byte>, nn::BasicDynamicCell<T>&,           \
                                                     nn::BasicOptimizer<T>&);

DUET_DETAIL_ELEMENT(float)
DUET_DETAIL_ELEMENT(double)

#undef DUET_DETAIL_ELEMENT

}  // namespace duet
