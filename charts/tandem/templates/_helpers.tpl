{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.cluster -}}{{ fail "redis.cluster needs redis.externalUrl (a node of your Redis Cluster) and redis.enabled=false" }}{{- end -}}
{{- if .Values.redis.enabled -}}redis://{{ include "tandem.fullname" . }}-redis:6379/0{{- else -}}{{ required "redis.externalUrl is required when redis.enabled=false" .Values.redis.externalUrl }}{{- end -}}
{{- end -}}

{{- define "tandem.secretName" -}}{{ include "tandem.fullname" . }}-secrets{{- end -}}


{{- define "tandem.tokenSecretRef" -}}
{secretKeyRef: {name: {{ .Values.internalTokenSecret.name | default (include "tandem.secretName" .) }}, key: {{ .Values.internalTokenSecret.key | default "internal-token" }}}}
{{- end -}}


{{- /* The model folder at /models/<name> (model.source): a volume, its mount, and for
huggingface an init container that downloads it (`tokenizerOnly` for the router). */ -}}
{{- define "tandem.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim: {claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}, readOnly: true}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath: {path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}, type: Directory}
{{- else if eq $m.source "imageVolume" }}
- name: model
  image: {reference: {{ required "model.imageVolume.reference is required with model.source=imageVolume" $m.imageVolume.reference }}, pullPolicy: {{ $m.imageVolume.pullPolicy }}}
{{- else if eq $m.source "huggingface" }}
- name: model
  emptyDir: {sizeLimit: {{ $m.huggingface.sizeLimit }}}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "image" }}
- name: model
  mountPath: /models/{{ $m.name }}
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
  readOnly: {{ ne $m.source "huggingface" }}
{{- end }}
{{- end -}}

{{- define "tandem.modelInit" -}}
{{- $m := .root.Values.model -}}
{{- if eq $m.source "huggingface" }}
- name: download-model
  image: {{ .image | quote }}
  command: [tandem]
  args:
    - prepare-model
    - --hf-repo={{ required "model.huggingface.repo is required with model.source=huggingface" $m.huggingface.repo }}
    {{- with $m.huggingface.revision }}
    - --revision={{ . }}
    {{- end }}
    - --out=/models/{{ $m.name }}
    {{- if .tokenizerOnly }}
    - --tokenizer-only
    {{- end }}
  env:
    - {name: HF_HOME, value: /tmp/hf}
    {{- with $m.huggingface.endpoint }}
    - {name: HF_ENDPOINT, value: {{ . | quote }}}
    {{- end }}
    {{- with $m.huggingface.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $m.huggingface.tokenSecret.key }}}}
    {{- end }}
  securityContext: {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts: [{name: model, mountPath: /models/{{ $m.name }}}]
{{- end }}
{{- end -}}


{{- /* Where vLLM's KV event sockets are (vllm.kvEvents): `bind` for vLLM (it binds ipc:// and
wildcard tcp:// addresses, and connects to any other), `connect` for the sidecar. ipc sockets live in
the kv-events emptyDir shared by the two containers. */ -}}
{{- define "tandem.kvEventsEndpoint" -}}
{{- $e := .root.Values.vllm.kvEvents -}}
{{- if eq $e.transport "ipc" -}}ipc:///run/tandem-kv/{{ .socket }}
{{- else -}}tcp://{{ if .bind }}*{{ else }}127.0.0.1{{ end }}:{{ eq .socket "events" | ternary $e.eventsPort $e.replayPort }}
{{- end -}}
{{- end -}}

{{- /* The topic of a vLLM pod's events: llm-d's kv@<pod>@<model>. */ -}}
{{- define "tandem.kvEventsTopic" -}}kv@$(POD_NAME)@{{ .Values.model.name }}{{- end -}}

{{- /* A vLLM OpenAI server with the NixlConnector, as a prefill or decode worker behind Tandem's
router (router/vllm_backend.py): the NIXL side channel on the worker's KV port, the internal
token as vLLM's API key; with vllm.kvEvents, its KV cache events (with replay) for the bridge. */ -}}
{{- define "tandem.vllmContainer" -}}
{{- $root := .root -}}
{{- $w := .w -}}
{{- $v := $root.Values.vllm -}}
- name: worker
  image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [python3, -m, vllm.entrypoints.openai.api_server]
  args:
    - --model=/models/{{ $root.Values.model.name }}
    - --served-model-name={{ $root.Values.model.name }}
    - --host=0.0.0.0
    - --port={{ $w.port }}
    - --block-size={{ $root.Values.model.blockSize }}
    - --tensor-parallel-size={{ $w.gpus | default 1 }}
    - --gpu-memory-utilization={{ $v.gpuMemoryUtilization }}
    - --max-num-seqs={{ $w.maxNumSeqs }}
    {{- with $v.maxModelLen }}
    - --max-model-len={{ . }}
    {{- end }}
    - '--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    - --enable-prompt-tokens-details  # answers report their cached prompt tokens
    {{- if $v.kvEvents.enabled }}
    {{- $events := include "tandem.kvEventsEndpoint" (dict "root" $root "socket" "events" "bind" true) }}
    {{- $replay := include "tandem.kvEventsEndpoint" (dict "root" $root "socket" "replay" "bind" true) }}
    - {{ printf `--kv-events-config={"enable_kv_cache_events":true,"publisher":"zmq","endpoint":%q,"replay_endpoint":%q,"buffer_steps":%d,"topic":%q}` $events $replay (int $v.kvEvents.bufferSteps) (include "tandem.kvEventsTopic" $root) | squote }}
    {{- end }}
    {{- range concat $v.extraArgs $w.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - {name: HOME, value: /tmp}  # a non-root user: vLLM's caches go under $HOME
    - {name: VLLM_NIXL_SIDE_CHANNEL_HOST, value: $(POD_IP)}
    - {name: VLLM_NIXL_SIDE_CHANNEL_PORT, value: {{ $w.transportPort | quote }}}
    - name: VLLM_API_KEY
      valueFrom: {{ include "tandem.tokenSecretRef" $root }}
    {{- with $w.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: http, containerPort: {{ $w.port }}}
    - {name: kv, containerPort: {{ $w.transportPort }}}
    {{- if and $v.kvEvents.enabled (eq $v.kvEvents.transport "tcp") }}
    - {name: kv-events, containerPort: {{ $v.kvEvents.eventsPort }}}
    - {name: kv-replay, containerPort: {{ $v.kvEvents.replayPort }}}
    {{- end }}
  # vLLM answers /health once the engine is up; loading a large model takes minutes.
  startupProbe: {httpGet: {path: /health, port: http}, periodSeconds: 10, failureThreshold: 180}
  livenessProbe: {httpGet: {path: /health, port: http}, periodSeconds: 10, timeoutSeconds: 5}
  readinessProbe: {httpGet: {path: /health, port: http}, periodSeconds: 5, timeoutSeconds: 3}
{{- end -}}

{{- /* The `tandem vllm-bridge` sidecar of a vLLM pod (vllm_bridge/): it reads the server on
loopback and its KV events (with replay), registers it in Redis under the pod's name with its stable
DNS URL, signed with the internal token, and publishes its cache as Tandem block hashes. The router
image: it has the tandem CLI and no torch. The model folder, where mounted, gives the model's digest
(config and tokenizer files) as Tandem workers compute it. */ -}}
{{- define "tandem.vllmBridge" -}}
{{- $root := .root -}}
{{- $w := .w -}}
{{- $e := $root.Values.vllm.kvEvents -}}
{{- $img := $root.Values.image.router -}}
- name: tandem-bridge
  image: {{ include "tandem.image" (dict "root" $root "which" "router") | quote }}
  imagePullPolicy: {{ $img.pullPolicy }}
  command: [tandem, --log-json, vllm-bridge]
  args:
    - --vllm-url=http://127.0.0.1:{{ $w.port }}
    - --advertise-url=http://$(POD_NAME).{{ .name }}.{{ $root.Release.Namespace }}.svc:{{ $w.port }}
    - --events-endpoint={{ include "tandem.kvEventsEndpoint" (dict "root" $root "socket" "events") }}
    - --replay-endpoint={{ include "tandem.kvEventsEndpoint" (dict "root" $root "socket" "replay") }}
    - --topic={{ include "tandem.kvEventsTopic" $root }}
    - --role={{ .role }}
    - --worker-id=$(POD_NAME)
    - --redis-url={{ include "tandem.redisUrl" $root }}
    {{- if $root.Values.redis.cluster }}
    - --redis-cluster
    {{- end }}
    - --namespace={{ $root.Release.Name }}
    {{- if ne $root.Values.model.source "image" }}
    - --model-folder=/models/{{ $root.Values.model.name }}
    {{- end }}
    {{- range $e.bridge.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: TANDEM_BRIDGE_INTERNAL_TOKEN  # signs the registration
      valueFrom: {{ include "tandem.tokenSecretRef" $root }}
    - name: TANDEM_BRIDGE_VLLM_API_KEY  # the vLLM server's VLLM_API_KEY
      valueFrom: {{ include "tandem.tokenSecretRef" $root }}
  securityContext: {{- toYaml $root.Values.securityContext | nindent 4 }}
  resources: {{- toYaml $e.bridge.resources | nindent 4 }}
  {{- $modelMount := include "tandem.modelMount" $root }}
  {{- if or (eq $e.transport "ipc") $modelMount }}
  volumeMounts:
    {{- if eq $e.transport "ipc" }}
    - {name: kv-events, mountPath: /run/tandem-kv}
    {{- end }}
    {{- $modelMount | nindent 4 }}
  {{- end }}
{{- end -}}

{{- /* With engine: vllm and no KV events, the router lists every vLLM pod (StatefulSet DNS names). */ -}}
{{- define "tandem.vllmWorkers" -}}
{{- $root := . -}}
{{- range $role := list "prefill" "decode" }}
{{- $w := index $root.Values $role }}
{{- $name := printf "%s-%s" (include "tandem.fullname" $root) $role }}
{{- range $i := until (int $w.replicas) }}
- --worker=vllm:{{ $role }}=http://{{ $name }}-{{ $i }}.{{ $name }}.{{ $root.Release.Namespace }}.svc:{{ $w.port }},model={{ $root.Values.model.name }}
{{- end }}
{{- end }}
{{- end -}}


{{- /* An image of ours, "repository:tag": `which` is router or worker. The repository is
required: these images are built and pushed by the operator (docker/build.sh). */ -}}
{{- define "tandem.image" -}}
{{- $img := index .root.Values.image .which -}}
{{- $msg := printf "image.%s.repository is not set: Tandem's images are not in a public registry. Build them (bash docker/build.sh), push them to your registry (or kind load docker-image / minikube image load) and install with --set image.router.repository=REGISTRY/tandem-router --set image.worker.repository=REGISTRY/tandem-worker (docs/deployment.md, Helm)" .which -}}
{{- printf "%s:%s" (required $msg $img.repository) $img.tag -}}
{{- end -}}
