@0xcdf11ba56c0a40d8;
# The chestnut message schema: every message on the wire and in the logs is one `Event`.
#
# Evolution rules (Cap'n Proto's own): fields and union members are only ever added, with the
# next free ordinal; nothing is renumbered, retyped or removed. Retired fields are renamed with a
# `deprecated` prefix and kept. Readers must tolerate union members they do not know
# (`which()` raises for them in pycapnp; msgs.messaging handles that).
#
# Units are in the names or in the comment of every field: ns = nanoseconds on CLOCK_MONOTONIC,
# s = seconds, ms = milliseconds.

struct Event {
  logMonoTime @0 :UInt64;   # ns, CLOCK_MONOTONIC, stamped by the publisher when the message is sent
  valid @1 :Bool = true;    # the publisher's own judgement that the content is usable (cereal semantics)

  union {
    initData @2 :InitData;
    cameraFrame @3 :CameraFrame;
    modelOutput @4 :ModelOutput;
    chestnutActive @5 :ChestnutActive;
    chestnutHealth @6 :ChestnutHealth;
    nodeState @7 :NodeState;
    controlState @8 :ControlState;
    twinState @9 :TwinState;
    twinFault @10 :TwinFault;
  }
}

# ---------------------------------------------------------------- shared types

enum ModelSource {
  none @0;        # nothing served (only before the first frame)
  primary @1;     # the primary model on the Chestnut dock (real or twin)
  fallback @2;    # the fallback model on the host CPU
}

enum Level {
  # ROS 2 diagnostic_msgs/DiagnosticStatus levels; a group's level is the worst of its parts.
  ok @0;
  warn @1;
  error @2;
  stale @3;       # no fresh evidence within the layer's staleness window
}

enum DType {
  float32 @0;
  float16 @1;
  uint8 @2;
  int32 @3;
  int64 @4;
  float64 @5;
  int8 @6;
  uint16 @7;
  int16 @8;
  uint32 @9;
  bool @10;
}

struct Tensor {
  name @0 :Text;
  shape @1 :List(UInt32);
  dtype @2 :DType;
  data @3 :Data;            # little-endian, C order, exactly prod(shape) * itemsize bytes
}

struct KeyValue {
  key @0 :Text;
  value @1 :Text;
}

struct Counter {
  name @0 :Text;
  value @1 :UInt64;
}

# ---------------------------------------------------------------- services

struct InitData {
  # The header of a log: what produced it and how it was configured.
  versions @0 :List(KeyValue);       # package -> version (chestnut, tinygrad, pycapnp, pyzmq, ...)
  config @1 :Text;                   # the node's effective configuration, as JSON
  hostname @2 :Text;
  wallTimeNanos @3 :UInt64;          # ns since the Unix epoch when the log started
  schemaHash @4 :Text;               # sha256 of this schema file's text
  segmentSeconds @5 :Float32;        # s, nominal segment length
  identity @6 :List(KeyValue);       # host and dock: tinygrad, host_os, usb_id, usb_path (bus, port, address),
                                     # usb_speed_mbps, bridge_firmware, gpu_arch, gpu_firmware (backend/probe.py
                                     # IDENTITY_KEYS); the dock's fields "unknown" until a worker qualified it.
                                     # The model files, once the node declared its contract (node/contract.py
                                     # file_identity): model_file, model_sha256, model_bytes, model_check (what its
                                     # known-answer check found: "unchecked: no fingerprint recorded" without one),
                                     # and fallback_* alike for a fallback file of its own
}

struct CameraFrame {
  frameId @0 :UInt32;                # strictly increasing per camera session
  timestampSof @1 :UInt64;           # ns, CLOCK_MONOTONIC, start of frame
  timestampEof @2 :UInt64;           # ns, CLOCK_MONOTONIC, end of frame (readout done)
  width @3 :UInt32;                  # px
  height @4 :UInt32;                 # px
  encoding @5 :PixelEncoding;
  data @6 :Data;                     # height * width * channels bytes (nv12: height * width * 3/2),
                                     # row-major, no padding
  sourceName @7 :Text;               # where the frames come from (file name, device)
  buffer @8 :FrameBuffer;            # set when the pixels are in the camera's shared-memory ring and
                                     # `data` is empty (msgs/visionipc.py); unset for inline frames
  video @9 :VideoFrameRef;           # set in a log when chestnut record wrote the pixels to a video file
                                     # beside the segment and `data` is empty (msgs/video.py); never on the bus

  enum PixelEncoding {
    bgr888 @0;                       # 3 bytes per pixel, B, G, R
    rgb888 @1;
    gray8 @2;
    nv12 @3;                         # YUV 4:2:0, 1.5 bytes per pixel: `height` rows of Y, then height/2
                                     # rows of interleaved U, V (width/2 pairs); width and height even
  }
}

struct FrameBuffer {
  # Where a cameraFrame's pixels are in the camera's ring of shared-memory buffers (msgs/visionipc.py).
  session @0 :UInt64;                # identity of the ring; a new value means map the buffers again
  index @1 :UInt32;                  # slot of the ring holding this frame
  seq @2 :UInt64;                    # sequence number of this frame in the ring (from 1); the slot's
                                     # seqlock word reads 2*seq while it still holds this frame
  size @3 :UInt32;                   # bytes of pixels in the slot: height * width * channels
}

struct VideoFrameRef {
  # Where a logged cameraFrame's pixels are: one frame of a video file in the log's segment directory,
  # written by chestnut record --frames video (msgs/video.py).
  file @0 :Text;                     # plain file name inside the segment directory, e.g. "fcamera.mkv"
  index @1 :UInt32;                  # frame number in that file, from 0, in decode order
  codec @2 :Text;                    # FFmpeg encoder: "ffv1" (lossless) or "libx264"
  lossless @3 :Bool;                 # decoding gives back the camera's bytes exactly
  crc32 @4 :UInt32;                  # CRC-32 (zlib) of the pixels as the camera sent them; 0: not recorded.
                                     # A lossless frame that decodes to other bytes is refused as damaged
}

struct ModelOutput {
  frameId @0 :UInt32;                # the cameraFrame this output answers
  source @1 :ModelSource;            # which model produced these tensors
  modelId @2 :Text;                  # identity of the model that produced it: "<name>@<sha256[:16]>"
  outputs @3 :List(Tensor);          # named output tensors
  executionTime @4 :Float32;         # s, inference time of the serving model
  frameAge @5 :Float32;              # s, publish time minus the frame's timestampEof
  frameDropPerc @6 :Float32;         # %, frames skipped, openpilot modeld's filtered measure
  deadlineMissed @7 :Bool;           # the primary missed the per-frame deadline; fallback answered
  primaryAgrees @8 :Bool;            # hot standby: primary and fallback agreed within tolerance
  agreementChecked @9 :Bool;         # whether primaryAgrees was evaluated for this frame
  maxAbsDiff @10 :Float32;           # largest |primary - fallback| when both ran, else 0
  reason @11 :Text;                  # why this source served this frame (empty when primary is active)
  copyInTime @12 :Float32;           # s, the primary's copy of this frame's inputs into VRAM; 0 for the fallback
  computeTime @13 :Float32;          # s, the serving model's compute (primary: program launch to fence)
  copyOutTime @14 :Float32;          # s, the primary's copy of the outputs back to host memory; 0 for the fallback
  deadline @15 :Float32;             # s, the primary's deadline in force for this frame (adaptive, docs/health.md);
                                     # 0 when the primary was not asked (and in older logs)
}

struct ChestnutActive {
  active @0 :Bool;                   # true only while all four layers are OK and the primary serves
  source @1 :ModelSource;
  reason @2 :Text;                   # why active is what it is (first failing layer/step, or "all layers OK")
  since @3 :UInt64;                  # ns, CLOCK_MONOTONIC, when `active` last changed
}

struct LayerHealth {
  layer @0 :Layer;
  level @1 :Level;
  reason @2 :Text;
  counters @3 :List(Counter);
  lastChange @4 :UInt64;             # ns, CLOCK_MONOTONIC, when `level` (or `advisory`) last changed
  lastEvidence @5 :UInt64;           # ns, CLOCK_MONOTONIC, when this layer was last observed
  advisory @6 :Bool;                 # a WARN that informs (a stage over its share, the deadline not at
                                     # risk): the layer counts as OK for ChestnutActive (docs/health.md)

  enum Layer {
    usb @0;                          # VID/PID, product string, link speed, transfers
    pcie @1;                         # LTSSM 0x78, TLP completions
    gpu @2;                          # architecture, fence progress within the wait timeout, hangs
    output @3;                       # finite, shape/dtype, range, not stale, agrees with fallback
  }
}

struct ChestnutHealth {
  layers @0 :List(LayerHealth);      # exactly one entry per layer, in Layer order
  overall @1 :Level;                 # the worst of the layers (the host is not one: docs/health.md)
  host @2 :HostHealth;               # whether the host itself is late; never a dock layer, never in `overall`
}

# The host beside the dock (docs/health.md "The host"): a deadline miss while the host was late is the
# host's, counted here and not against the gpu layer. ok: on time; warn: late within the last second.
struct HostHealth {
  level @0 :Level;
  reason @1 :Text;                   # e.g. "host late: loop woke 38 ms late, cpu pressure 64 %"
  loopLateMs @2 :Float32;            # the node's loop: worst wake-up lateness within the window, ms
  workerLateMs @3 :Float32;          # the worker's heartbeat timer: likewise, ms
  cpuPressure @4 :Float32;           # /proc/pressure/cpu some avg10, %; NaN where absent
  lateMisses @5 :UInt32;             # deadline misses blamed on the host since the node started
  lastLate @6 :UInt64;               # ns, CLOCK_MONOTONIC, the last such miss (0: none yet)
  twinWaitMs @7 :Float32;            # the twin's worst thread's wait for a host CPU within the window, ms (0: a real dock)
}

struct NodeState {
  state @0 :State;
  reason @1 :Text;                   # why the node is in this state (the transition's reason)
  since @2 :UInt64;                  # ns, CLOCK_MONOTONIC, entry into `state`
  workerPid @3 :Int32;               # 0 when no primary worker runs
  restarts @4 :UInt32;               # primary worker restarts since the node started
  versions @5 :List(KeyValue);
  standby @6 :Text;                  # "hot" or "warm"
  dock @7 :Text;                     # "twin", "real" or "none"
  framesIn @8 :UInt64;
  framesOut @9 :UInt64;
  identity @10 :List(KeyValue);      # as InitData.identity, from the latest worker that climbed the ladder

  enum State {
    starting @0;
    qualifying @1;
    loading @2;
    active @3;                       # primary serving
    degraded @4;                     # fallback serving
    recovering @5;                   # re-qualifying / shadow frames, fallback still serving
    stopping @6;
  }
}

struct ControlState {
  engaged @0 :Bool;
  softDisabling @1 :Bool;
  softDisableRemaining @2 :Float32;  # s left before control is exited (openpilot: 3 s)
  events @3 :List(Text);             # e.g. "modelLagging", "commIssue", "modelSourceChanged"
  canEngage @4 :Bool;                # all checks pass right now
  allowSourceSwitch @5 :Bool;        # the consumer allows the model source to change now
}

struct TwinState {
  present @0 :Bool;
  bus @1 :UInt8;
  address @2 :UInt8;
  speedMbps @3 :UInt32;
  ltssm @4 :UInt8;
  faults @5 :List(Text);             # active faults, "<kind>#<id>" (fired count after a colon)
  programEngine @6 :Text;            # how the twin's GPU executes programs: tinygrad | onnxruntime
  wedged @7 :Bool;                   # the bridge is wedged until power-cycled
  phase @8 :Text;                    # idle | loading | serving | recovering
}

struct TwinFault {
  # One fault event of the twin, published when it happens (the 1 Hz twinState misses one-shot faults).
  id @0 :UInt32;                     # the fault's id in the twin's fault table
  kind @1 :Text;                     # fault kind (chestnut twin kinds), e.g. "gpu_hang"
  action @2 :Action;
  params @3 :Text;                   # the parameters given beyond the kind, as JSON (e.g. {"on": "bulk"}; {} for none)
  site @4 :Text;                     # fired: the transfer, TLP or packet it hit, e.g. "bulk out" or "packet #12"
  fired @5 :UInt32;                  # times fired so far (saturates at 2^32-1)
  opportunities @6 :UInt32;          # sites seen so far (saturates at 2^32-1)
  monoTime @7 :UInt64;               # ns, CLOCK_MONOTONIC, when the event happened in the twin

  enum Action {
    armed @0;                        # injected
    fired @1;                        # hit a transfer / TLP / packet
    cleared @2;                      # removed by a client (chestnut twin clear)
    expired @3;                      # spent (a one-shot fault that fired) or past its --for duration
  }
}
