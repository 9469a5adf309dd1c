// A tokenizer seen from a token file: what the file records of it, and the encoder the writer calls.
#pragma once
#include "dataset/token_file.h"
#include "tokenizer/tokenizer.h"

namespace hs::dataset {

// Fingerprint, size, end-of-text separator and the byte length of every id.
Vocabulary vocabulary_of(const tokenizer::Tokenizer& t);
// encode() on one thread, encode_parallel() on more; shares the tokenizer.
Encoder encoder_of(const tokenizer::Tokenizer& t);

}  // namespace hs::dataset
