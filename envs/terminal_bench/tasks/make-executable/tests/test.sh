#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when both scripts are executable and build.sh has run, else 0.
mkdir -p /logs/verifier
if [ -x bin/build.sh ] && [ -x bin/deploy.sh ] && [ -f build.log ] && grep -q "^built from" build.log; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
