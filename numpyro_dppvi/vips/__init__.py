"""VIPS: private variational Bayes for conjugate-exponential models (Park et al. 2020).

Public names: :func:`fit_vips`, :class:`VIPSResult`, the :class:`ConjugateModel`
interface and the models (:class:`BayesianLinearRegression`,
:class:`NormalGammaLinearRegression`, :class:`BetaBernoulli`, :class:`DirichletCategorical`,
:class:`GammaPoisson`, :class:`PolyaGammaLogisticRegression`, :class:`LDA`,
:class:`SigmoidBeliefNet`), :func:`detect_conjugate` and :func:`conjugate_client_delta`
for federated VIPS.
"""

from numpyro_dppvi.vips.conjugate_pairs import BetaBernoulli, DirichletCategorical, GammaPoisson
from numpyro_dppvi.vips.detect import Detection, detect_conjugate
from numpyro_dppvi.vips.engine import ConjugateModel, ConjugateModelBase
from numpyro_dppvi.vips.federated import conjugate_client_delta, conjugate_server_update
from numpyro_dppvi.vips.fit import fit_vips
from numpyro_dppvi.vips.lda import LDA
from numpyro_dppvi.vips.linear import BayesianLinearRegression, NormalGammaLinearRegression
from numpyro_dppvi.vips.logistic import PolyaGammaLogisticRegression
from numpyro_dppvi.vips.polya_gamma import polya_gamma_mean, sample_polya_gamma
from numpyro_dppvi.vips.results import VIPSResult
from numpyro_dppvi.vips.sbn import SigmoidBeliefNet

__all__ = [
    "BayesianLinearRegression",
    "BetaBernoulli",
    "ConjugateModel",
    "ConjugateModelBase",
    "Detection",
    "DirichletCategorical",
    "GammaPoisson",
    "LDA",
    "NormalGammaLinearRegression",
    "PolyaGammaLogisticRegression",
    "SigmoidBeliefNet",
    "VIPSResult",
    "conjugate_client_delta",
    "conjugate_server_update",
    "detect_conjugate",
    "fit_vips",
    "polya_gamma_mean",
    "sample_polya_gamma",
]
