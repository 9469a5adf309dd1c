// Moving tensors between a Hugging Face checkpoint and an in-memory stacked ParamSet (for eval, train --init and the
// parity tests). The streaming file-to-file converters are in convert.h.
#pragma once
#include <string>
#include <vector>

#include "checkpoint/hf_layout.h"
#include "checkpoint/sharded.h"
#include "model/params.h"

namespace hs::checkpoint {

// Fills `params` from the checkpoint (dtype-converting each element). Every decoder tensor must be present with its
// exact shape; tensors that are not part of the text decoder (mtp.*, model.visual.*) are skipped and listed in the
// returned notes; any other unexpected tensor is an error. Errors name the checkpoint and the tensor.
std::vector<std::string> load_hf_params(const CheckpointReader& r, model::ParamSet& params);

// The elements of HF tensor `t` gathered from a stacked fp32/bf16 ParamSet as fp32 (e.g. gradients by HF name).
std::vector<float> hf_tensor_from(const model::ParamSet& ps, const HfTensor& t);

}  // namespace hs::checkpoint
