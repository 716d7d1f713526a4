// Builds against the installed duet::distributed target (duet/distributed.hpp and MPI).
#include <duet/distributed.hpp>
#include <duet/duet.hpp>

#include <iostream>

int main() {
  duet::distributed::init();
  duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  std::cout << "rank " << duet::distributed::get_rank() << " of " << duet::distributed::get_group_size() << '\n';
}
