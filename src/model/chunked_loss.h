#pragma once
// The loss without the logits: the head's matrix product and the cross-entropy, a chunk of tokens
// at a time. Whole, the fp32 logits of a micro-batch are tokens x vocabulary (32 x 1024 tokens x
// 128k words is 16 GiB, twice over with their gradient); here one chunk's exist at a time.
//
// The gradient is computed in the forward, chunk by chunk, while the chunk's logits exist
// (softmax minus the one-hot target, times the head weight for the input's gradient, times the
// input for the weight's), and backward only scales it by the incoming gradient: the loss is the
// last operation, so that gradient is a number (1, or 1/micro-batches under accumulation). No
// logit is computed twice.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/kernel_choices.h"
#include "model_parallel/tensor_parallel.h"

namespace zb {

// Mean over tokens of cross_entropy(x · wᵀ, targets): x [N, D] and w [V, D] in the compute dtype,
// targets [N] int64; logits in fp32 (float64 for float64 inputs), as Llama::head makes them.
// Gradients flow to x and w when they require them and grad mode is on; the weight's is summed
// over chunks in fp32. Equal to the unchunked loss and gradients within fp32 summation order.
//
// Vocabulary-parallel (tensor parallelism): with `vocab_group`, w holds words [vocab_start,
// vocab_start + V) of the vocabulary, the group's ranks the rest, and every rank has the same x
// and targets. Each chunk's log-sum-exp and target logit are combined over the group (one
// all-gather of 2 numbers a token), so no rank holds all the logits; every rank returns the whole
// loss, the gradient of x is this rank's words' part (to be summed over the group), w's its rows'.
at::Tensor chunked_cross_entropy(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets,
                                 int64_t chunk_tokens, ModelParallelGroup* vocab_group = nullptr,
                                 int64_t vocab_start = 0, const KernelChoices& kernels = {});

// Tokens per chunk for a vocabulary of `vocab`: one chunk's fp32 logits take at most 256 MiB on
// the CPU (523 tokens at 128k words, 2,048 at 32k; a whole CPU test micro-batch at 1k) and 1 GiB
// on a GPU (2,093 tokens at 128k words), where larger products run nearer the peak.
int64_t loss_chunk_tokens(int64_t vocab, bool cuda);

}  // namespace zb
