"""Speculative decoding: proposers guess the next tokens cheaply; the target model verifies them all in
one forward pass and the rejection sampler keeps exactly what the target alone would have produced."""
