"""Tests of numpyro_dppvi.vfl."""
