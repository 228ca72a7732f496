"""numpyro_dppvi: differentially private, federated Bayesian inference for NumPyro."""

__version__ = "0.1.0"
