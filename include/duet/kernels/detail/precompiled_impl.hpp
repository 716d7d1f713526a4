// The kernels' entry points for one instruction set, as explicit instantiations: declarations
// (extern template) in a program built with DUET_PRECOMPILED_KERNELS, definitions in the one
// file that defines DUET_DEFINE_PRECOMPILED_KERNELS (duet/precompiled_kernels.hpp says why).
// No include guard and no includes: per_isa.hpp includes it once per set, in that set's
// namespace, after every family's body. What an entry point calls (tiles, shuffles, folds)
// comes with it; an instance not listed is compiled where it is used, as without the macro.
//
// The element types are float and double; the functions a product or a map runs, none and the
// activations with a vector form (nn/activation.hpp), alone, as layers fuse them.

#define DUET_DETAIL_PRODUCT(T, ...)                                                                                \
  DUET_DETAIL_INSTANCE void Kernels::gemv_rows<T __VA_OPT__(, ) __VA_ARGS__>(const T*, index_t, index_t, const T*, \
                                                                             index_t, const T*, T*);               \
  DUET_DETAIL_INSTANCE void Kernels::blocked<T __VA_OPT__(, ) __VA_ARGS__>(                                        \
      const T*, index_t, index_t, const T*, index_t, const T*, T*, const PackedWeight<T>*);                        \
  DUET_DETAIL_INSTANCE void Kernels::narrow<T __VA_OPT__(, ) __VA_ARGS__>(const T*, index_t, index_t, const T*,    \
                                                                          index_t, const T*, T*);

#define DUET_DETAIL_FUNCTION(T, Fn)                                         \
  DUET_DETAIL_PRODUCT(T, Fn)                                                \
  DUET_DETAIL_INSTANCE void map_step<T, Fn>(Target, const T*, index_t, T*); \
  DUET_DETAIL_INSTANCE void map_grad_step<T, Fn>(Target, const T*, const T*, index_t, T*);

#define DUET_DETAIL_ACTIVATION(T, F)                                                    \
  DUET_DETAIL_INSTANCE void activation_step<Activation::F, 1, T>(Target, Vec<T>(&)[1]); \
  DUET_DETAIL_INSTANCE void activation_step<Activation::F, 8, T>(Target, Vec<T>(&)[8]);

#define DUET_DETAIL_ELEMENT(T)                                                                                       \
  DUET_DETAIL_PRODUCT(T)                                                                                             \
  DUET_DETAIL_FUNCTION(T, fn::Relu)                                                                                  \
  DUET_DETAIL_FUNCTION(T, fn::Sigmoid)                                                                               \
  DUET_DETAIL_FUNCTION(T, fn::Tanh)                                                                                  \
  DUET_DETAIL_FUNCTION(T, fn::Gelu<false>)                                                                           \
  DUET_DETAIL_FUNCTION(T, fn::Gelu<true>)                                                                            \
  DUET_DETAIL_FUNCTION(T, fn::Silu)                                                                                  \
  DUET_DETAIL_ACTIVATION(T, exp)                                                                                     \
  DUET_DETAIL_ACTIVATION(T, sigmoid)                                                                                 \
  DUET_DETAIL_ACTIVATION(T, tanh)                                                                                    \
  DUET_DETAIL_ACTIVATION(T, silu)                                                                                    \
  DUET_DETAIL_ACTIVATION(T, silu_derivative)                                                                         \
  DUET_DETAIL_ACTIVATION(T, gelu)                                                                                    \
  DUET_DETAIL_ACTIVATION(T, gelu_derivative)                                                                         \
  DUET_DETAIL_ACTIVATION(T, gelu_tanh)                                                                               \
  DUET_DETAIL_ACTIVATION(T, gelu_tanh_derivative)                                                                    \
  DUET_DETAIL_ACTIVATION(T, erf)                                                                                     \
  DUET_DETAIL_ACTIVATION(T, erf_derivative)                                                                          \
  DUET_DETAIL_INSTANCE void Kernels::blocked_kn<T>(const T*, index_t, index_t, const T*, index_t, T*, bool, bool);   \
  DUET_DETAIL_INSTANCE void Kernels::pack<T>(const T*, index_t, index_t, T*);                                        \
  DUET_DETAIL_INSTANCE void transpose_step<T>(Target, const T*, index_t, index_t, index_t, T*, index_t);             \
  DUET_DETAIL_INSTANCE void exp_step<T>(Target, const T*, index_t, T*);                                              \
  DUET_DETAIL_INSTANCE void scale_step<T>(Target, const T*, index_t, T, T*);                                         \
  DUET_DETAIL_INSTANCE T sum_step<T>(Target, const T*, index_t);                                                     \
  DUET_DETAIL_INSTANCE void column_sums_step<T>(Target, const T*, index_t, index_t, index_t, T*, bool);              \
  DUET_DETAIL_INSTANCE T log_sum_exp_step<T>(Target, const T*, index_t);                                             \
  DUET_DETAIL_INSTANCE T cross_entropy_step<T>(Target, const T*, const T*, index_t, T);                              \
  DUET_DETAIL_INSTANCE void softmax_grad_step<T>(Target, const T*, index_t, T, index_t, T, T*);                      \
  DUET_DETAIL_INSTANCE void softmax_grad_step<T>(Target, const T*, const T*, index_t, T, T, T, T*);                  \
  DUET_DETAIL_INSTANCE void add_bias_step<T>(Target, const T*, index_t, index_t, const T*, T*);                      \
  DUET_DETAIL_INSTANCE void adam_step<T>(Target, T*, const T*, T*, T*, index_t, const AdamCoefficients<T>&);         \
  DUET_DETAIL_INSTANCE void sgd_step<T>(Target, T*, const T*, T*, index_t, const SgdCoefficients<T>&);               \
  DUET_DETAIL_INSTANCE void direct_conv_step<T>(Target, const T*, index_t, index_t, const T*, index_t, index_t,      \
                                                index_t, index_t, index_t, index_t, T*);                             \
  DUET_DETAIL_INSTANCE void direct_weight_step<T>(Target, const T*, index_t, index_t, const T*, index_t, index_t,    \
                                                  index_t, index_t, index_t, index_t, T*);                           \
  DUET_DETAIL_INSTANCE void direct_weight_sums_step<T>(Target, const T*, index_t, T*, bool);                         \
  DUET_DETAIL_INSTANCE void max_pool_2x2_step<T>(Target, const T*, index_t, index_t, index_t, index_t, index_t, T*); \
  DUET_DETAIL_INSTANCE void max_pool_2x2_backward_step<T>(Target, const T*, const T*, index_t, index_t, index_t,     \
                                                          index_t, index_t, T*);                                     \
  DUET_DETAIL_INSTANCE void max_pool_step<T>(Target, const T*, const PoolShape&, T*);                                \
  DUET_DETAIL_INSTANCE void max_pool_backward_step<T>(Target, const T*, const T*, const PoolShape&, T*);             \
  DUET_DETAIL_INSTANCE void avg_pool_step<T>(Target, const T*, const PoolShape&, bool, T*);                          \
  DUET_DETAIL_INSTANCE void avg_pool_backward_step<T>(Target, const T*, const PoolShape&, bool, T*);

DUET_DETAIL_ELEMENT(float)
DUET_DETAIL_ELEMENT(double)

#undef DUET_DETAIL_ELEMENT
#undef DUET_DETAIL_ACTIVATION
#undef DUET_DETAIL_FUNCTION
#undef DUET_DETAIL_PRODUCT
