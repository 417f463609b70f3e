"""Generation: prompt planning, sampling, the decode loop, and speculative decoding with the MTP module."""
