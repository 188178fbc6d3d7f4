"""Inductor passes shipped with torch_kernels, each opt-in.

``install_fp8_fusion()`` adds the FP8 fusion pass (:mod:`.fp8_fusion`) to Inductor's post-grad custom
passes: a norm or an activation followed by an FP8 quantisation, ours or written in plain torch,
becomes one of our fused ops wherever that changes no bit (docs/compile.md, "The FP8 fusion pass").
"""

from .fp8_fusion import FP8_FUSION, Fp8FusionPass, install_fp8_fusion, uninstall_fp8_fusion

__all__ = ["FP8_FUSION", "Fp8FusionPass", "install_fp8_fusion", "uninstall_fp8_fusion"]
