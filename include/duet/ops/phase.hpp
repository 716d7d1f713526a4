// What the operations of layers that differ between training and evaluation share
// (nn::BatchNorm1d/2d, nn::Dropout): the phase they were made for, and the check that their
// layer is still set to it when they run.
//
// Such a layer appends the operation of its input's phase in graph capture (graph::phase_of),
// and of its own setting (set_train) in PyNative mode. Graph mode runs the form its layers ask
// for (pipeline::in_requested_phase, which reads requested_phase()); the check below refuses a
// form that one of its layers no longer agrees with (a layer switched alone, whose network was
// captured in the other phase) rather than running it stale.
#pragma once

#include <string>
#include <utility>

#include "../eager.hpp"
#include "../error.hpp"
#include "../graph.hpp"

namespace duet::ops {

// The base of such an operation, made for phase P by `layer`.
template <class Layer, graph::Phase P>
struct PhaseOf {
  static constexpr graph::Phase phase = P;

  Layer* layer;
  explicit PhaseOf(Layer* l) : layer(l) {}

  graph::Phase requested_phase() const { return layer->training() ? graph::Phase::train : graph::Phase::eval; }
  std::string layer_label() const { return layer->label(); }

  // Called first by the operation's kernel.
  void check_phase() const {
    if (requested_phase() == P) return;
    throw ModeError(layer->label() + " is set to " + (layer->training() ? "train" : "evaluate") +
                    " (set_train), but runs in a graph captured for " +
                    (P == graph::Phase::train ? "training" : "evaluation") +
                    "; graph mode captures a network in one phase, which all its layers must share: call "
                    "set_train on the whole network, or run it in PyNative mode");
  }
};

// What such a layer's construct does: applies Op<Layer, P> to x, P being x's phase in graph
// capture, and the layer's setting on a tensor (PyNative).
template <template <class, graph::Phase> class Op, class Layer, class X>
auto apply_in_phase(Layer* layer, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return apply(Op<Layer, graph::phase_of<X>()>{layer}, x);
  } else if (layer->training()) {
    return apply(Op<Layer, graph::Phase::train>{layer}, std::forward<X>(x));
  } else {
    return apply(Op<Layer, graph::Phase::eval>{layer}, std::forward<X>(x));
  }
}

}  // namespace duet::ops
