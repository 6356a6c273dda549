"""The docker-compose testbed, bmv2 variant (docs/DOCKER.md): simple_switch_grpc in the switch
container, the controller programming it over P4Runtime, four workers training through it to
gloo's accuracy. Skips, with the reason, without a Docker engine or a P4 image (P4_IMAGE, or the
one docker/p4-image-from-prefix.sh makes); it never pulls one."""

from __future__ import annotations

import os

import pytest

from switchagg_lab.testing.docker_testbed import check_training, load_testbed, skip_reason


# A cold run builds the images first (base, controller, worker: ~3 min here).
@pytest.mark.timeout(2400)
def test_the_bmv2_variant_trains_through_the_p4_switch() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tb = load_testbed()
    image = tb.default_p4_image()
    if not tb.image_exists(image):
        pytest.skip(f"no P4 image {image} (docker/p4-image-from-prefix.sh makes one from a bmv2 install)")
    check_training("bmv2", f"sab{os.getpid()}", "p4")
