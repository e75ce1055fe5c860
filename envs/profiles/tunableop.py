"""The GEMM-tuning layer (--tune-gemm on train.pretrain, profile.train and bench.gemm): PyTorch TunableOp
on, tuning on, its results in a file kept per GPU model, torch and CUDA/ROCm build, so that a shape tuned
once is read back by every later run with the same key instead of tuned again."""
from envs import computed as c
from envs.profiles import refs
from envs.spec import Profile, computed, setting

PROFILE = Profile("tunableop", "tuning", "GEMM tuning (--tune-gemm)", (
    setting("PYTORCH_TUNABLEOP_ENABLED", "1",
            "--tune-gemm: torch's GEMMs go through TunableOp, which uses the tuned solution of each shape",
            refs.TORCH_TUNABLEOP),
    setting("PYTORCH_TUNABLEOP_TUNING", "1",
            "--tune-gemm: a shape not in the results file is tuned once (all candidate solutions timed), then kept",
            refs.TORCH_TUNABLEOP),
    computed("PYTORCH_TUNABLEOP_FILENAME", c.tunableop_file,
             "--tune-gemm: the results file of this GPU model, torch and CUDA/ROCm build, reused by every later "
             "run with the same key",
             f"{refs.TORCH_TUNABLEOP}; Anvil's cache key", per_node=False),
))
