nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); inc=$(dirname $(dirname $nvcc))/include
gcc -O2 -o /tmp/attr4 .gpu-exp/attr4.c -I$inc -lcuda && /tmp/attr4
for lay in default bottom; do
  for mode in tcp shm; do
    REMORA_SERVE_LAYOUT=$([ $lay = default ] && echo default || echo x) REMORA_LOG="warn,remora_client=debug" timeout 120 .device-bin/remora run --profile --transport $mode -- python3 gpu/torch/train.py cnn --steps 40 > /dev/null 2> /tmp/e.$lay.$mode
    echo "== $lay $mode rc=$?: $(grep -o '"median_step_ms": [0-9.]*' /tmp/e.$lay.$mode)"
    grep "mirrored at device\|collid\|reserve" /tmp/e.$lay.$mode | cut -c1-250 | sort | uniq -c | sort -rn | head -8
    grep -A5 "^remora client profile" /tmp/e.$lay.$mode
    grep -c "remora_client" /tmp/e.$lay.$mode
  done
done
cp /tmp/e.bottom.tcp $OUT/e.bottom.tcp.txt; cp /tmp/e.default.tcp $OUT/e.default.tcp.txt
