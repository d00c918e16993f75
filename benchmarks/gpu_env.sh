# Source on the lent GPU, from the folder of the checkout to install (the repository root, or a staged
# copy of it): installs jax-triton 0.3.1 (carried as a wheel in $WHEELS, default <repo root>/.whl) and
# this package into /tmp/site, and puts /tmp/site on PYTHONPATH. The GPU image has jax 0.11.2,
# triton 3.6 and setuptools; nothing can be downloaded there.
WHEELS=${WHEELS:-$(git rev-parse --show-toplevel 2>/dev/null || pwd)/.whl}
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$WHEELS"/*.whl || return 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# From another folder: in the checkout, the source folder moe_front_jax/ (without its pallas and bridge
# subpackages) would shadow the installed package.
(cd /tmp && python3 -c "import jax, moe_front_jax; print('jax', jax.__version__, jax.devices())")
