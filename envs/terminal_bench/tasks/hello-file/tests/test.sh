#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when hello.txt holds the line Hello, world!, else 0.
mkdir -p /logs/verifier
if [ -f hello.txt ] && [ "$(cat hello.txt)" = "Hello, world!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
