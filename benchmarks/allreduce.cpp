// The gradient all-reduce of duet::distributed against gradient size, beside MPI's own blocking
// MPI_Allreduce of the same floats (which cannot time out, so duet does not use it: the floor
// duet's polled, nonblocking, bucketed form is held against). Run on 2 or more ranks:
//
//   mpirun --allow-run-as-root -np 2 build/benchmarks/duet_allreduce
//
// Each size is a Dense layer's weight and bias (the last row: the seed network's three layers,
// 2.68 MB), reduced by distributed::GradReducer as a hand-written training loop does, 60 times
// after a barrier each; rank 0 prints the best and the median in ms. Wall time: on a machine
// whose cores run other jobs the collective waits for the slowest rank, so measure it idle.
#include <duet/distributed.hpp>
#include <duet/duet.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu_model.hpp"

namespace {

using namespace duet;

struct Times {
  double best;
  double median;
};

template <class F>
Times time_of(F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < 60; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2]};
}

void row(const std::string& what, std::vector<nn::Dense<>>& layers) {
  std::vector<nn::NamedParameter<float>> params;
  for (nn::Dense<>& layer : layers) {
    for (const nn::NamedParameter<float>& p : layer.parameters()) params.push_back(p);
  }
  distributed::GradReducer reducer(params);
  std::vector<Tensor> grads;
  index_t floats = 0;
  // A value per rank: gradients equal on every rank are refused by the reducer's first call
  // (the sign of a loader that is not sharded).
  const float value = 1.0f + static_cast<float>(distributed::get_rank());
  for (const nn::NamedParameter<float>& p : params) {
    grads.push_back(full(p.parameter->shape(), value));
    floats += p.parameter->numel();
  }
  const Times duet = time_of([&] { reducer(grads, 32); });
  std::vector<float> flat(static_cast<std::size_t>(floats), 1.0f);
  const Times mpi = time_of([&] {
    MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(floats), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  });
  if (distributed::get_rank() == 0) {
    std::printf("| %s | %.2f MB | %.3f | %.3f | %.3f | %.3f |\n", what.c_str(), static_cast<double>(floats) * 4e-6,
                duet.best, duet.median, mpi.best, mpi.median);
  }
}

}  // namespace

int main() {
  try {
    distributed::init();
    set_seed(1);
    if (distributed::get_rank() == 0) {
      const auto setting = [](const char* name) {
        const char* value = std::getenv(name);
        return value != nullptr ? value : "(unset)";
      };
      std::printf("%s, %d ranks, %s, libnbc iallreduce algorithm %s, vader single copy %s\n\n",
                  duet_bench::cpu_model().c_str(), distributed::get_group_size(), kernel_isa().data(),
                  setting("OMPI_MCA_coll_libnbc_iallreduce_algorithm"), setting("OMPI_MCA_btl_vader_single_copy_mechanism"));
      std::printf("| gradients | size | duet best ms | duet median ms | MPI_Allreduce best ms | median ms |\n");
      std::printf("|---|---:|---:|---:|---:|---:|\n");
    }
    for (const index_t n : {32, 128, 256, 512, 2048}) {
      std::vector<nn::Dense<>> layer;
      layer.emplace_back(n - 1, n);
      row("Dense(" + std::to_string(n - 1) + ", " + std::to_string(n) + ")", layer);
    }
    std::vector<nn::Dense<>> seed;
    seed.emplace_back(784, 512);
    seed.emplace_back(512, 512);
    seed.emplace_back(512, 10);
    row("the seed network", seed);
  } catch (const Error& e) {
    distributed::abort(std::string("duet_allreduce: ") + e.what());
  }
  return 0;
}
