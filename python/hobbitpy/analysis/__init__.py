"""Analyses of traces and outputs: likelihoods, scores, the cache simulator, neuron sparsity, prices."""
