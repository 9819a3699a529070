{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The resource name prefix, cut to 40 characters: the longest suffix the chart appends is
"-registry-token" (15 → Service and Secret names stay within 63) and a StatefulSet's
"-redis" must stay within 52 (its pods get a 63-character controller-revision-hash). */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Common labels; call with (dict "ctx" $ "component" "prefill"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "pdserve.selectorLabels" . }}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Registry URL every node and the router talks to. */}}
{{- define "pdserve.registryUrl" -}}
{{- printf "http://%s-registry:%v" (include "pdserve.fullname" .) .Values.registry.port -}}
{{- end -}}

{{- define "pdserve.tokenSecretName" -}}
{{- default (printf "%s-registry-token" (include "pdserve.fullname" .)) .Values.registry.auth.existingSecret -}}
{{- end -}}

{{/* The registry's --store value: "internal", "external" or "memory". */}}
{{- define "pdserve.storeKind" -}}
{{- if .Values.redis.enabled -}}internal{{- else if .Values.externalRedis.url -}}external{{- else -}}memory{{- end -}}
{{- end -}}

{{/* Env vars shared by nodes and the router: the pod's IP and name. The registry token is a
mounted file (pdserve.tokenMount), never an env var or an argument. */}}
{{- define "pdserve.commonEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PYTHONUNBUFFERED
  value: "1"
{{- with (include "pdserve.hfTokenEnv" . | trim) }}
{{ . }}
{{- end }}
{{- end -}}

{{/* A Hub token (model.hfTokenSecret) as a mounted file that huggingface_hub reads. */}}
{{- define "pdserve.hfTokenEnv" -}}
{{- if .Values.model.hfTokenSecret }}
- name: HF_TOKEN_PATH
  value: /etc/pdserve/hf-token/token
{{- end }}
{{- end -}}

{{/* The registry token Secret as a file: volume, mount, and the flag pointing at it. */}}
{{- define "pdserve.tokenPath" -}}/etc/pdserve/registry-token/token{{- end -}}
{{- define "pdserve.tokenVolume" -}}
{{- if .Values.registry.auth.enabled }}
- name: registry-token
  secret:
    secretName: {{ include "pdserve.tokenSecretName" . }}
{{- end }}
{{- end -}}
{{- define "pdserve.tokenMount" -}}
{{- if .Values.registry.auth.enabled }}
- name: registry-token
  mountPath: /etc/pdserve/registry-token
  readOnly: true
{{- end }}
{{- end -}}

{{/* The registry token: the value, else the one already in the cluster (so upgrades keep
it), else a new random one. With `helm template` (GitOps) there is no cluster to ask: set
registry.auth.token or existingSecret there, or every render makes a new token. */}}
{{- define "pdserve.registryToken" -}}
{{- $token := .Values.registry.auth.token -}}
{{- if not $token -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "pdserve.tokenSecretName" .) -}}
{{- if and $old $old.data (hasKey $old.data "token") -}}
{{- $token = index $old.data "token" | b64dec -}}
{{- else -}}
{{- $token = randAlphaNum 40 -}}
{{- end -}}
{{- $_ := set .Values.registry.auth "token" $token -}}{{/* same value for every caller */}}
{{- end -}}
{{- $token -}}
{{- end -}}

{{/* Checksums of the Secrets a pod reads, as pod annotations: a changed token or password
restarts the pods that use it. (dict "ctx" $ "store" bool) */}}
{{- define "pdserve.secretChecksums" -}}
{{- $ := .ctx -}}
{{- if and $.Values.registry.auth.enabled (not $.Values.registry.auth.existingSecret) }}
checksum/registry-token: {{ include "pdserve.registryToken" $ | sha256sum }}
{{- end }}
{{- if .store }}
checksum/registry-store: {{ include "pdserve.storeUrl" $ | sha256sum }}
{{- end }}
{{- end -}}

{{/* The bundled Redis's password: the value, else the one in the cluster, else random. */}}
{{- define "pdserve.redisPassword" -}}
{{- $pw := .Values.redis.auth.password -}}
{{- if not $pw -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (printf "%s-redis" (include "pdserve.fullname" .)) -}}
{{- if and $old $old.data (hasKey $old.data "password") -}}
{{- $pw = index $old.data "password" | b64dec -}}
{{- else -}}
{{- $pw = randAlphaNum 32 -}}
{{- end -}}
{{- $_ := set .Values.redis.auth "password" $pw -}}
{{- end -}}
{{- $pw -}}
{{- end -}}

{{/* The registry's store URL (kept in a Secret: it may hold a password). */}}
{{- define "pdserve.storeUrl" -}}
{{- $store := include "pdserve.storeKind" . -}}
{{- if eq $store "internal" -}}
{{- $auth := ternary (printf ":%s@" (include "pdserve.redisPassword" .)) "" .Values.redis.auth.enabled -}}
{{- printf "redis://%s%s-redis:%v/%v" $auth (include "pdserve.fullname" .) .Values.redis.port .Values.redis.db -}}
{{- else if eq $store "external" -}}
{{- .Values.externalRedis.url -}}
{{- else -}}
memory
{{- end -}}
{{- end -}}

{{/* --model-cache-dir: with model.prepare and model.volume the init step converts onto the
volume (a folder below mountPath), so the main containers find the model there. */}}
{{- define "pdserve.cacheDir" -}}
{{- if and .Values.model.prepare .Values.model.volume -}}
{{- printf "%s/pdserve-models" .Values.model.mountPath -}}
{{- else -}}
{{- .Values.model.cacheDir -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations: Prometheus scrape hints plus the tier's own; (dict "ctx" $ "port" N "extra" map). */}}
{{- define "pdserve.podAnnotations" -}}
{{- $ann := dict -}}
{{- if .ctx.Values.metrics.podAnnotations -}}
{{- $_ := set $ann "prometheus.io/scrape" "true" -}}
{{- $_ := set $ann "prometheus.io/port" (.port | toString) -}}
{{- $_ := set $ann "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- $ann = merge (deepCopy (.extra | default dict)) $ann -}}
{{- if $ann }}{{ toYaml $ann }}{{ end -}}
{{- end -}}

{{/* Probes: liveness on /livez (the process works: a node whose scheduler died, never a
router whose node tier is down), readiness on /readyz (send it work: false while a node
drains or the router has no usable pair). (dict "port" "http" "startup" .Values.pd.startupProbe) */}}
{{- define "pdserve.probes" -}}
{{- if .startup }}
startupProbe:
  httpGet:
    path: /livez
    port: {{ .port }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
{{- end }}
livenessProbe:
  httpGet:
    path: /livez
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
{{- end -}}

{{/* preStop sleep: the pod leaves Service endpoints (router) and the registry is re-read
before SIGTERM starts the drain. (dict "seconds" N) */}}
{{- define "pdserve.preStop" -}}
{{- if gt (int .seconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .seconds | toString | quote }}]
{{- end }}
{{- end -}}

{{/* A soft spread of a tier's pods over nodes; (dict "ctx" $ "component" "decode"). */}}
{{- define "pdserve.topologySpread" -}}
{{- $t := .ctx.Values.topologySpread -}}
{{- if $t.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ $t.maxSkew }}
    topologyKey: {{ $t.topologyKey }}
    whenUnsatisfiable: {{ $t.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "pdserve.selectorLabels" . | nindent 8 }}
{{- end }}
{{- end -}}

{{/* Model volumes (pod level) for the tiers that load the model. */}}
{{- define "pdserve.modelVolumes" -}}
{{- if .Values.model.volume }}
- name: models
{{ toYaml .Values.model.volume | indent 2 }}
{{- end }}
{{- if and .Values.model.prepare (not .Values.model.volume) }}
- name: model-cache
  emptyDir: {}
{{- end }}
{{- with .Values.model.hfTokenSecret }}
- name: hf-token
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMounts" -}}
{{- if .Values.model.volume }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ .Values.model.readOnly }}
{{- end }}
{{- if and .Values.model.prepare (not .Values.model.volume) }}
- name: model-cache
  mountPath: {{ include "pdserve.cacheDir" . }}
{{- end }}
{{- if .Values.model.hfTokenSecret }}
- name: hf-token
  mountPath: /etc/pdserve/hf-token
  readOnly: true
{{- end }}
{{- end -}}

{{/* Init step converting a built-in model into the cache dir (model.prepare). */}}
{{- define "pdserve.modelInit" -}}
{{- if .Values.model.prepare }}
initContainers:
  - name: prepare-model
    image: {{ include "pdserve.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["pdserve"]
    args:
      - generate
      - --model
      - {{ .Values.model.name | quote }}
      - --model-cache-dir
      - {{ include "pdserve.cacheDir" . | quote }}
      {{- with .Values.model.revision }}
      - --revision
      - {{ . | quote }}
      {{- end }}
      - --load-format
      - {{ .Values.model.loadFormat | quote }}
      - --device
      - cpu
      - --max-new-tokens
      - "1"
      - --prompt
      - warmup
    {{- with .Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with (include "pdserve.hfTokenEnv" . | trim) }}
    env:
      {{- . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- if .Values.model.volume }}
      - name: models
        mountPath: {{ .Values.model.mountPath }}
      {{- else }}
      - name: model-cache
        mountPath: {{ include "pdserve.cacheDir" . }}
      {{- end }}
      {{- if .Values.model.hfTokenSecret }}
      - name: hf-token
        mountPath: /etc/pdserve/hf-token
        readOnly: true
      {{- end }}
{{- end }}
{{- end -}}
